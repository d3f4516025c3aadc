"""What a 4-bit artifact's decode step computes around its fused stack (models/fused_stack.py), joined
to it in one C++ call (kernels/cpu_decode.py's decode_token_w4a8): the embedding's rows, scaled as the
config says, then the stack, the final norm and the W4A8 head. At batch 1 the Python of those calls
cost a 30-layer model ~0.3-0.6 ms a token, for each Python object they touch is a cache miss after
the step has streamed the model's weights (docs/results.md). Taken where the embedding is a plain
table of the activations' dtype, the final norm rounds as the stack's norms, the head is a W4A8 layer
without a bias and the logits are neither scaled nor capped; elsewhere the model's own calls run.
Kept, as the stack's weights are, while the modules and tensors it comes from stand.
"""

from typing import TYPE_CHECKING

import torch
from torch import nn

from optkit.kernels import cpu_decode
from optkit.models.derived import Derived, slot, tensors_of

if TYPE_CHECKING:
    from optkit.models.llama import CausalLM

# W4A8Stack.args' eps, cast_first and offset (the rule every norm of the stack shares)
_STACK_NORM_RULE = slice(12, 15)
_enabled = True


def one_call(on: bool) -> bool:
    """Whether decode steps take the one call where they can (on unless set off here); the previous
    setting. For A/B runs in one process (bench/cpu_stack_region.py --compare token-call)."""
    global _enabled
    previous, _enabled = _enabled, on
    return previous


class _Kept:
    """The tail's weights: the embedding table, the final norm as the C++ norm takes it, the head's layout."""

    def __init__(self, embedding: torch.Tensor, norm: cpu_decode.NormArgs, head: "cpu_decode.W4A8Packed"):
        self.embedding, self.norm, self.head = embedding, norm, head


def tail(model: "CausalLM", h: torch.Tensor, stack: cpu_decode.W4A8Stack) -> cpu_decode.W4A8Tail | None:
    """The tail of a decode step whose stack is `stack` and whose embedded input is h [B, hidden], as
    decode_token_w4a8 takes it; None where the model's own calls must compute it."""
    config = model.config
    if not _enabled or config.logits_scaling != 1.0 or config.final_logit_softcapping is not None:
        return None
    kept = _weights(model, h)
    if kept is None or (kept.norm.eps, kept.norm.cast_first, kept.norm.offset) != stack.args[_STACK_NORM_RULE]:
        return None
    return cpu_decode.W4A8Tail.of(kept.embedding, _embedding_scale(config, h.dtype), kept.norm.weight, kept.head)


def _embedding_scale(config, dtype: torch.dtype) -> float:
    """The factor config.scale_embeddings multiplies the rows by, as that multiply takes it (Gemma's
    rounded to the activations' dtype first)."""
    if config.round_embedding_multiplier:
        return float(torch.tensor(config.embedding_multiplier, dtype=dtype))
    return float(config.embedding_multiplier)


def _weights(model: "CausalLM", h: torch.Tensor) -> _Kept | None:
    kept = model.__dict__.get("_w4a8_tail")
    key = (h.dtype, h.shape[0])
    if kept is None or kept[0] != key or not kept[1].stands():
        kept = (key, _gather(model, h))
        model.__dict__["_w4a8_tail"] = kept
    derived = kept[1]
    if derived.value is None or derived.hooked():  # the module call would run the hook
        return None
    return derived.value


def _gather(model: "CausalLM", h: torch.Tensor) -> Derived:
    """The tail's weights (None where the call cannot take them), watching the embedding, the final
    norm and the head in their slots, and their tensors."""
    slots = [slot(model.model, "embed_tokens"), slot(model.model, "norm"), slot(model, "lm_head")]
    embedding, norm, head = (module for _, _, module in slots)
    if type(embedding) is not nn.Embedding or head is None or not hasattr(head, "w4a8_for"):  # a PackedIntLinear
        return Derived(None, slots)
    slots += [t for module in (embedding, norm, head) for t in tensors_of(module)]
    weight = embedding.weight
    if embedding.max_norm is not None or weight.dtype != h.dtype:
        return Derived(None, slots)
    layout = head.w4a8_for(h)
    norm_args = norm.cpu_operator_args(h.dtype) if hasattr(norm, "cpu_operator_args") else None
    if layout is None or head.bias is not None or norm_args is None or not weight.is_contiguous():
        return Derived(None, slots)
    return Derived(_Kept(weight, norm_args, layout), slots)
