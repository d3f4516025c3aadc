"""A decoder layer of a 4-bit artifact's decode step in one C++ call (models/llama.py's
DecoderLayer.decode_in_one_call, kernels/cpu_decode.py's decode_layer_w4a8): the layer's weights as
that call takes them, gathered once and kept while the layer stands (models/derived.py).

At batch 1 on a small model, gathering the weights again at every step (nn.Module's attribute lookups
and each packed layer's checks, with the caches cold from the weights just streamed) took about as
long as the call itself (docs/results.md, issue 38).
"""

import torch
from torch import nn

from optkit.kernels import cpu_decode, cpu_int4, cpu_w4a8
from optkit.models.derived import Derived, slot, tensors_of


def w4a8_weights(layer: nn.Module, h: torch.Tensor) -> cpu_decode.W4A8Layer | None:
    """A DecoderLayer's weights (its MLP a gated one) as decode_layer_w4a8 takes them for activations
    like `h`; None where the call cannot take the layer, or where a forward hook watches a part of it
    (looked for at every call: registering one changes no weight)."""
    if layer.post_norms or layer.residual_multiplier != 1.0 or not cpu_decode.enabled(h):
        return None
    limit = cpu_w4a8.MAX_KERNEL_ROWS
    key = (h.dtype, limit is None or h.shape[0] <= limit, cpu_int4.available())
    kept = layer.__dict__.get("_w4a8_decode")
    if kept is None or kept[0] != key or not kept[1].stands():
        kept = (key, gather(layer, h))
        layer.__dict__["_w4a8_decode"] = kept
    derived = kept[1]
    if derived.value is None or derived.hooked():  # one call would run past the hook
        return None
    return derived.value


def gather(layer: nn.Module, h: torch.Tensor) -> Derived:
    """The layer's weights for decode_layer_w4a8 (None where it cannot take them) and what they come
    from: the attention, the MLP, their four linears (packed, q|k|v and gate|up fused) and the norms."""
    names = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    names += ("pre_feedforward_layernorm", "post_feedforward_layernorm") if layer.sandwich_norms else ()
    slots = [slot(layer, name) for name in names]
    attn, mlp = layer.self_attn, layer.mlp
    slots += [slot(attn, "qkv_proj"), slot(attn, "o_proj"), slot(mlp, "gate_up_proj"), slot(mlp, "down_proj")]
    linears = [module for _, _, module in slots[-4:]]
    if not all(hasattr(m, "w4a8_for") for m in linears):  # PackedIntLinear
        return Derived(None, slots)
    norm_modules = [module for _, _, module in slots[2 : len(names)]]
    if attn.qk_norm == "head":
        slots += [slot(attn, "q_norm"), slot(attn, "k_norm")]
    slots += [t for _, _, module in slots[2:] for t in tensors_of(module)]
    layouts = [m.w4a8_for(h) for m in linears]
    norms = [norm.cpu_operator_args(h.dtype) for norm in norm_modules]
    head_norms = attn.head_norm_args(h.dtype)
    if any(layout is None for layout in layouts) or any(norm is None for norm in norms) or head_norms is None:
        return Derived(None, slots)
    if not all(norms[0].same_rule(norm) for norm in [*norms, *head_norms] if norm is not None):
        return Derived(None, slots)
    biases = [None if m.bias is None else m.bias.to(h.dtype) for m in linears]
    weights = cpu_decode.W4A8Layer.of(list(zip(layouts, biases, strict=True)), norms, head_norms, mlp.gelu)
    return Derived(weights, slots)
