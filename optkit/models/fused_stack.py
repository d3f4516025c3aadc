"""A 4-bit artifact's whole decoder stack of a decode step in one C++ call (models/llama.py's
CausalLM.forward, kernels/cpu_decode.py's decode_stack_w4a8): every layer as its own fused call
(models/fused_layer.py) computes it, the same bits, without the model's loop and each layer's Python
around its call (the module call, its weights' check, its attention's arguments), which at batch 1
on a small model of many thin layers cost about as long as the layers' attention (docs/results.md,
issue 38). The stack's weights are gathered once and kept while every layer and what each watches
stand (models/derived.py); a forward hook on any layer or part of one is looked for at every call.
"""

from collections.abc import Callable
from operator import is_

import torch
from torch import nn

from optkit.kernels import cpu_decode, cpu_int4, cpu_w4a8
from optkit.kernels.kv_cache import QuantizedKVCache
from optkit.kernels.paged_attention import AttentionMetadata, decode_tables
from optkit.models import fused_layer
from optkit.models.derived import Derived, slot


class _Kept:
    """The stack's weights and what each step reads of its attentions (their windows, head counts
    and scales are plain attributes: read at every step, as the layer-by-layer path reads them)."""

    def __init__(self, stack: cpu_decode.W4A8Stack, attentions: list[nn.Module]):
        self.stack, self.attentions = stack, attentions


def decode(
    layers: nn.ModuleList,
    fusable: Callable[[nn.Module], bool],
    h: torch.Tensor,
    rope: list[tuple[torch.Tensor, torch.Tensor]],
    rope_index: list[int],
    metas: list[AttentionMetadata],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor | None:
    """h [B, hidden] through every layer of a decode-only step -> the last layer's output, or None
    where one call cannot run the stack (the model then runs its layers one by one). `fusable(layer)`:
    whether the layer is the plain decoder layer the fused call computes; `rope`: the step's RoPE
    tables, layer i taking rope[rope_index[i]]; `metas` and `kv_caches`: each layer's."""
    steps = decode_steps(layers, fusable, h, [rope], rope_index, [metas], kv_caches)
    return None if steps is None else steps.run(h, 0)


def _weights(layers: nn.ModuleList, fusable: Callable[[nn.Module], bool], h: torch.Tensor) -> _Kept | None:
    if not cpu_decode.enabled(h):
        return None
    limit = cpu_w4a8.MAX_KERNEL_ROWS
    key = (h.dtype, limit is None or h.shape[0] <= limit, cpu_int4.available())
    kept = layers.__dict__.get("_w4a8_stack")
    if kept is None or kept[0] != key or not kept[1].stands():
        kept = (key, _gather(layers, fusable, h))
        layers.__dict__["_w4a8_stack"] = kept
    derived = kept[1]
    if derived.value is None or derived.hooked():  # one call would run past the hook
        return None
    return derived.value


def _gather(layers: nn.ModuleList, fusable: Callable[[nn.Module], bool], h: torch.Tensor) -> Derived:
    """Every layer's fused weights (fused_layer's gather) as one stack, watching the layers' slots in
    the list and every slot each layer's weights come from."""
    slots = [slot(layers, name) for name in layers._modules]
    values = []
    for _, _, layer in list(slots):
        if layer is None or not fusable(layer) or layer.post_norms or layer.residual_multiplier != 1.0:
            return Derived(None, slots)
        derived = fused_layer.gather(layer, h)
        slots += zip(derived.holders, derived.names, derived.held, strict=True)
        if derived.value is None or layer.self_attn.softcap is not None:
            return Derived(None, slots)
        values.append(derived.value)
    stack = cpu_decode.W4A8Stack.of(values)
    if stack is None:
        return Derived(None, slots)
    return Derived(_Kept(stack, [layer.self_attn for _, _, layer in slots[: len(layers)]]), slots)


def decode_steps(
    layers: nn.ModuleList,
    fusable: Callable[[nn.Module], bool],
    h: torch.Tensor,
    rope: list[list[tuple[torch.Tensor, torch.Tensor]]],
    rope_index: list[int],
    metas: list[list[AttentionMetadata]],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> "Steps | None":
    """`decode` for n decode steps in a row (models/llama.py's CausalLM.decode_steps), the stack's
    calls prepared at once: its weights checked and every step's arguments built before the first
    runs; None where one call cannot run the stack. rope[i] and metas[i]: step i's, as `decode`
    takes them; h: step 0's input (its dtype and rows are every step's)."""
    kept = _weights(layers, fusable, h)
    if kept is None or not _takes(kept, h, rope[0], kv_caches):
        return None
    layout = _Layout(kept, rope_index, metas[0], kv_caches)
    steps = []
    for step_rope, step_metas in zip(rope, metas, strict=True):
        step_args = layout.step_args(h, step_rope, step_metas)
        if step_args is None:
            return None
        steps.append(step_args)
    return Steps(kept.stack, steps)


class Steps:
    """The stack's calls of n decode steps, their arguments made (`decode_steps`)."""

    def __init__(self, stack: cpu_decode.W4A8Stack, step_args: list[tuple]):
        self.stack, self.step_args = stack, step_args

    def run(self, h: torch.Tensor, i: int) -> torch.Tensor:
        """Step i: h [B, hidden] through every layer -> the last layer's output."""
        return cpu_decode.decode_stack_w4a8(h, self.stack, self.step_args[i])

    def logits(self, input_ids: torch.Tensor, tail: cpu_decode.W4A8Tail, i: int) -> torch.Tensor:
        """Step i from its tokens: input_ids long [B] -> float32 logits [B, vocab] (models/fused_tail.py)."""
        return cpu_decode.decode_token_w4a8(input_ids, tail, self.stack, self.step_args[i])


def _takes(kept: _Kept, h: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]], kv_caches: list[tuple]) -> bool:
    """Whether the fused call takes these attentions, RoPE tables and caches (as
    paged_attention.fused_decode_attention decides for one layer)."""
    attentions = kept.attentions
    num_heads, scale = attentions[0].num_heads, attentions[0].scale
    if any(a.num_heads != num_heads or a.scale != scale or a.softcap is not None for a in attentions):
        return False
    tables = [t for pair in rope for t in pair]
    if any(t.dtype != h.dtype or not t.is_contiguous() for t in tables):
        return False
    caches = [t for pair in kv_caches for t in pair]
    return not any(isinstance(t, QuantizedKVCache) or t.dtype != h.dtype or not t.is_contiguous() for t in caches)


class _Layout:
    """What every step of a `decode_steps` call passes alike: each layer's caches, window and KV cache
    group (the layers that share step 0's metadata object share a group), the heads and scale; a
    step's arguments then take only its RoPE tables and each group's tables (`step_args`)."""

    def __init__(
        self,
        kept: _Kept,
        rope_index: list[int],
        metas: list[AttentionMetadata],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ):
        group_of, self.firsts, self.group_index = {}, [], []  # firsts: each group's first layer
        for layer, (meta, (k_cache, _)) in enumerate(zip(metas, kv_caches, strict=True)):
            key = (id(meta), k_cache.shape[1])
            if key not in group_of:
                group_of[key] = len(self.firsts)
                self.firsts.append(layer)
            self.group_index.append(group_of[key])
        self.block_sizes = [kv_caches[layer][0].shape[1] for layer in self.firsts]
        attentions = kept.attentions
        self.windows = [a.window or 0 for a in attentions]
        self.num_heads, self.scale, self.rope_index = attentions[0].num_heads, attentions[0].scale, rope_index
        self.k_caches, self.v_caches = (list(caches) for caches in zip(*kv_caches, strict=True))

    def step_args(
        self, h: torch.Tensor, rope: list[tuple[torch.Tensor, torch.Tensor]], metas: list[AttentionMetadata]
    ) -> tuple | None:
        """A step's trailing arguments of decode_stack_w4a8, in its schema's order; None where a group's
        tables are not a decode-only step's, or the step's layers share metadata otherwise than step 0's."""
        group_metas = [metas[layer] for layer in self.firsts]
        if not all(map(is_, (group_metas[g] for g in self.group_index), metas)):
            return None
        slots, tables, lens = [], [], []
        for meta, block_size in zip(group_metas, self.block_sizes, strict=True):
            found = decode_tables(meta, block_size, h.shape[0])
            if found is None:
                return None
            slots.append(found[0])
            tables.append(found[1])
            lens.append(found[2])
        cos, sin = (list(tables) for tables in zip(*rope, strict=True))
        return (
            cos, sin, self.rope_index, self.k_caches, self.v_caches, slots, tables, lens, self.group_index,
            self.num_heads, self.scale, self.windows, cpu_decode.avx512(),
        )  # fmt: skip
