"""The small operators of a CPU decode step in C++ (cpu_decode.cpp), float32 or bfloat16: RMSNorm, RoPE,
and attention of one query token per sequence over the paged KV cache.

Why: a decode step of a small model on a CPU runs about a hundred ATen operators per layer, each
paying dispatch, temporaries and OpenMP wake-ups whatever its size (F.rms_norm of one row is six
operators; the paged gather and masked SDPA of one decode are more), so at batch 1 a 4-bit model's
step spent as long there as in its matmuls (docs/results.md). One call each instead:
  rms_norm(x, w, eps)  x / sqrt(mean(x²) + eps) · w per row, rounded as models/llama.py's RMSNorm
  rope(x, cos, sin)    models/llama.py's apply_rope, the same bits (each product and sum rounded)
  decode_attention     softmax(scale · q·Kᵀ) V per (sequence, query head), K and V read in place
                       through the block table, no gather, no mask tensor
  decode_attention_qkv a decode step's attention from the fused q|k|v projection: the per-head q/k
                       norms, RoPE, the cache write and decode_attention, the same bits as the four
                       (what a layer ran as ~12 operators and their Python, one call)
  decode_layer_w4a8    a whole decoder layer of a decode step whose linears are W4A8 layers (its
                       norms, the four W4A8 calls, the attention above, the adds and activation)
  decode_stack_w4a8    every layer of such a model's decode step, each layer's call in turn; at up to
                       4 float32 rows, every layer inside one OpenMP region of ATen's threads, which
                       meet at spin barriers instead of starting ~5 regions a layer (the same bits)
  decode_token_w4a8    a decode step of such a model from its tokens to its logits: the embedding,
                       the stack above, the final norm and the W4A8 head (the same bits, no Python
                       between them)
  argmax               greedy decoding's torch.argmax over each row of float32 logits, the same index
In bfloat16 each value is computed in float32 and rounded where the PyTorch code writes a bfloat16
tensor. The model code takes them on the CPU (`enabled(tensor)`); everything else, and
OPTKIT_CPU_OPS=0 (the reference, for A/B runs), takes the PyTorch code beside each call. Attention
uses AVX-512 where the CPU has it, unless capped to AVX2 (OPTKIT_CPU_ISA=avx2: kernels/cpp_build.py).
"""

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from optkit.errors import OptkitError
from optkit.kernels import cpp_build

if TYPE_CHECKING:  # cpu_w4a8 imports this module
    from optkit.kernels.cpu_w4a8 import W4A8Packed

SOURCE = Path(__file__).with_name("cpu_decode.cpp")


@functools.cache
def unavailable_reason() -> str:
    """An empty string when the operators run here; otherwise why not (built once per process)."""
    if os.environ.get("OPTKIT_CPU_OPS", "") == "0":
        return "OPTKIT_CPU_OPS=0"
    return cpp_build.load(SOURCE, "optkit_cpu_decode")


DTYPES = (torch.float32, torch.bfloat16)


def enabled(x: torch.Tensor) -> bool:
    """Whether the C++ operators take this activation: float32 or bfloat16, on the CPU, the library loaded."""
    return x.dtype in DTYPES and x.device.type == "cpu" and not unavailable_reason()


def describe(dtype: torch.dtype) -> str:
    """Which code runs RMSNorm, RoPE and decode attention on the CPU for activations of `dtype`, in words."""
    reason = unavailable_reason() or ("" if dtype in DTYPES else f"{dtype} activations")
    if reason:
        return f"PyTorch ({reason})"
    if avx512() and torch.ops.optkit_cpu.has_avx512():
        return "optkit C++ (AVX-512)"
    return f"optkit C++ ({'AVX2 attention, ' if torch.ops.optkit_cpu.has_avx2_fma() else ''}portable loops)"


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cast_first: bool = True, offset: float = 0.0
) -> torch.Tensor | None:
    """x [..., K] -> n = x / sqrt(mean(x²) + eps) in float32, then as models/llama.py's RMSNorm: n · weight
    (float32 x), bf16(bf16(n) · weight) (bfloat16 x, `cast_first`: LlamaRMSNorm), bf16(n · (offset +
    weight)) (Olmo2RMSNorm; Gemma's offset 1, also in float32). None where the PyTorch code's result has
    another dtype than x (a cast-first weight of another dtype, a float32 x with a bfloat16 weight)."""
    if not rms_norm_takes(x.dtype, weight.dtype, cast_first, offset):
        return None
    try:
        return torch.ops.optkit_cpu.rms_norm(x, weight, eps, cast_first and not offset, offset)
    except ValueError as e:  # the operator's shape checks (a model whose sizes disagree)
        raise shape_error(e) from e


def rms_norm_takes(x_dtype: torch.dtype, weight_dtype: torch.dtype, cast_first: bool, offset: float) -> bool:
    """Whether `rms_norm` computes this norm (its result has x's dtype, as the PyTorch code's)."""
    # with an offset, or a bfloat16 x weighted after the cast, the weight multiplies n in float32 and the
    # result is cast to x's dtype: any weight dtype gives x's; otherwise the weight's dtype must be x's
    in_float32 = offset != 0.0 or (not cast_first and x_dtype == torch.bfloat16)
    return weight_dtype in DTYPES and (weight_dtype == x_dtype or in_float32)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (heads contiguous), cos and signed sin [T, 1, R] -> contiguous [T, H, D] rotated."""
    try:
        return torch.ops.optkit_cpu.rope(x, cos, sin)
    except ValueError as e:
        raise shape_error(e) from e


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1), the same indices: for float32 logits [R, V] on the CPU in C++ (two
    vector passes a row, the max then its first index; ATen's reduction took ~7x its own max on a
    vocabulary row), else ATen's."""
    if logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[-1] > 0 and enabled(logits):
        return torch.ops.optkit_cpu.argmax(logits, avx512())
    return logits.argmax(dim=-1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [B, Hq, D], one token per sequence; caches [N, block_size, Hkv, D] of q's dtype; block_tables long [B, nb];
    lens long [B]: the keys of each sequence, its query the last -> [B, Hq, D]."""
    try:
        return torch.ops.optkit_cpu.decode_attention(
            q, k_cache, v_cache, block_tables, lens, scale, window or 0, avx512()
        )
    except ValueError as e:
        raise shape_error(e) from e


@dataclass(frozen=True)
class NormArgs:
    """A per-head RMSNorm as `rms_norm` takes it (models/llama.py's RMSNorm.cpu_operator_args)."""

    weight: torch.Tensor  # [D]
    eps: float
    cast_first: bool
    offset: float

    def same_rule(self, other: "NormArgs") -> bool:
        """Whether both norms round alike (decode_attention_qkv takes one eps, cast and offset)."""
        return (self.eps, self.cast_first, self.offset) == (other.eps, other.cast_first, other.offset)


HeadNorms = tuple[NormArgs | None, NormArgs | None]  # the q and k norms of a head, or none


@dataclass(frozen=True)
class DecodeAttention:
    """A decode-only step's attention in one layer as the C++ calls take it (B sequences, one token each)."""

    num_heads: int
    cos: torch.Tensor  # [B, 1, R] and the signed sin, as `rope` takes them
    sin: torch.Tensor
    k_cache: torch.Tensor  # [N, block_size, Hkv, D], written at slot_mapping
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # long [B]
    block_tables: torch.Tensor  # long [B, nb]
    lens: torch.Tensor  # long [B]: the keys of each sequence, its new one included
    scale: float
    window: int | None

    def op_args(self) -> tuple:
        """The operators' trailing arguments, in their schema's order."""
        caches = (self.k_cache, self.v_cache, self.slot_mapping, self.block_tables, self.lens)
        return (self.cos, self.sin, *caches, self.num_heads, self.scale, self.window or 0, avx512())


def decode_attention_qkv(
    qkv: torch.Tensor, q_norm: NormArgs | None, k_norm: NormArgs | None, step: DecodeAttention
) -> torch.Tensor:
    """A decode step's attention from the fused projection qkv [B, (Hq + 2·Hkv)·D]: the per-head norms
    (q_norm and k_norm of one eps, cast and offset), `rope`, the keys and values written at the step's
    slots, and `decode_attention`, in one call with those operators' bits -> [B, Hq, D]."""
    norm = q_norm or k_norm
    eps, cast_first, offset = (norm.eps, norm.cast_first, norm.offset) if norm else (0.0, False, 0.0)
    weights = (q_norm and q_norm.weight, k_norm and k_norm.weight)
    try:
        return torch.ops.optkit_cpu.decode_attention_qkv(qkv, *weights, eps, cast_first, offset, *step.op_args())
    except ValueError as e:
        raise shape_error(e) from e


@dataclass(frozen=True)
class W4A8Layer:
    """A decoder layer's weights as decode_layer_w4a8 takes them, in its schema's order: built once
    and kept by the layer while its modules and weights stand (models/fused_layer.py), so a decode
    step's call passes them as they are rather than gathering them again."""

    args: tuple

    @classmethod
    def of(
        cls,
        linears: list[tuple["W4A8Packed", torch.Tensor | None]],
        norms: list[NormArgs],
        head_norms: HeadNorms,
        gelu_tanh: bool,
    ) -> "W4A8Layer":
        """`linears`: qkv, o, gate_up and down as (W4A8 layout, bias in the activations' dtype or None);
        `norms`: the input and post-attention norms, then for sandwich norms (Gemma) the pre- and
        post-feedforward ones, all of one eps, cast and offset with the per-head `head_norms`."""
        from optkit.kernels import cpu_w4a8

        w, p, b, n, g = zip(
            *[(k.weight, k.params, bias, k.out_features, k.group_size) for k, bias in linears], strict=True
        )
        pre_ffw, post_ffw = (norms[2].weight, norms[3].weight) if len(norms) == 4 else (None, None)
        q_norm, k_norm = (norm.weight if norm else None for norm in head_norms)
        rule = norms[0]
        return cls((
            list(w), list(p), list(b), list(n), list(g), cpu_w4a8.selected_isa(), norms[0].weight, norms[1].weight,
            pre_ffw, post_ffw, q_norm, k_norm, rule.eps, rule.cast_first, rule.offset, gelu_tanh,
        ))  # fmt: skip


def decode_layer_w4a8(h: torch.Tensor, layer: W4A8Layer, step: DecodeAttention) -> torch.Tensor:
    """models/llama.py's DecoderLayer for one decode step in one call, the same bits: h [B, hidden] ->
    [B, hidden], with the layer's weights and this step's attention."""
    try:
        return torch.ops.optkit_cpu.decode_layer_w4a8(h, *layer.args, *step.op_args())
    except ValueError as e:
        raise shape_error(e) from e


@dataclass(frozen=True)
class W4A8Stack:
    """A decoder stack's W4A8 layers as decode_stack_w4a8 takes them: each argument of the layers'
    W4A8Layer.args flattened over the layers (lists joined, per-layer tensors listed), the scalars
    the layers share once."""

    args: tuple

    @classmethod
    def of(cls, layers: list[W4A8Layer]) -> "W4A8Stack | None":
        """None where the layers differ in what the call takes once (the kernel, the norms' eps, cast
        and offset, the activation)."""
        if not layers:
            return None
        columns = list(zip(*[layer.args for layer in layers], strict=True))
        shared = [columns[5], *columns[12:16]]  # isa; eps, cast_first, offset, gelu_tanh
        if any(len(set(column)) != 1 for column in shared):
            return None
        linears = [[item for per_layer in column for item in per_layer] for column in columns[:5]]
        return cls((*linears, columns[5][0], *map(list, columns[6:12]), *(column[0] for column in columns[12:16])))


def decode_stack_w4a8(h: torch.Tensor, stack: W4A8Stack, step_args: tuple) -> torch.Tensor:
    """`decode_layer_w4a8` through every layer of the stack in turn, in one call, the same bits: h
    [B, hidden] -> the last layer's output [B, hidden]; `step_args`: the step's attention in every
    layer, in the schema's order (models/fused_stack.py's _Layout.step_args): RoPE tables (cos and
    signed sin [B, 1, R]) and rope_index, each layer's caches, the KV cache groups' slot mappings,
    block tables and lens and each layer's group_index, num_heads, scale, windows, avx512."""
    try:
        return torch.ops.optkit_cpu.decode_stack_w4a8(h, *stack.args, *step_args)
    except ValueError as e:
        raise shape_error(e) from e


@dataclass(frozen=True)
class W4A8Tail:
    """What a decode step computes around its W4A8 stack, as decode_token_w4a8 takes it: the embedding
    table [vocab, hidden] of the activations' dtype and the factor its rows are scaled by (1.0: none),
    the final norm's weight (its eps, cast and offset the stack's) and the W4A8 head (no bias)."""

    args: tuple

    @classmethod
    def of(
        cls, embedding: torch.Tensor, embed_scale: float, final_norm: torch.Tensor, head: "W4A8Packed"
    ) -> "W4A8Tail":
        return cls((embedding, embed_scale, final_norm, head.weight, head.params, head.out_features, head.group_size))


def decode_token_w4a8(input_ids: torch.Tensor, tail: W4A8Tail, stack: W4A8Stack, step_args: tuple) -> torch.Tensor:
    """A decode step from its tokens to its logits in one call: input_ids long [B] -> float32 logits
    [B, vocab], the same bits as the embedding, `decode_stack_w4a8`, the final norm and the head."""
    try:
        return torch.ops.optkit_cpu.decode_token_w4a8(input_ids, *tail.args, *stack.args, *step_args)
    except ValueError as e:
        raise shape_error(e) from e


def stack_in_one_region(on: bool) -> bool:
    """Whether decode_stack_w4a8 runs its layers in one parallel region where it can (on unless set
    off here); the previous setting (False where the operators do not run here). For A/B runs in one
    process (bench/cpu_stack_region.py)."""
    return not unavailable_reason() and bool(torch.ops.optkit_cpu.stack_in_one_region(on))


def one_region_steps() -> int:
    """How many decode_stack_w4a8 calls of this process ran in one parallel region."""
    return 0 if unavailable_reason() else int(torch.ops.optkit_cpu.one_region_steps())


def shape_error(e: ValueError) -> OptkitError:
    """A C++ operator's refusal of its arguments' shapes (TORCH_CHECK_VALUE: ValueError; an internal
    invariant, such as a block table, raises RuntimeError instead) as one line for the user: the
    shapes come from the model's config.json and weights."""
    reason = next(iter(str(e).splitlines()), "")[:300]
    return OptkitError(f"optkit's C++ {reason}: check config.json against the checkpoint")


@functools.cache
def avx512() -> bool:
    """AVX-512 unless capped to AVX2 (read once per process); the operator also asks the CPU."""
    return not cpp_build.capped_to_avx2()
