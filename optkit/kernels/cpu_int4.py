"""W4A16 on the CPU through PyTorch's int4 kernel (`aten._weight_int4pack_mm_for_cpu`, AVX-512/AVX2).

The kernel computes y = x · Ŵᵀ with bf16 activations, its weight packed by
`aten._convert_weight_to_int4pack_for_cpu` from unsigned 4-bit values u in [0, 15] [N, K], and
scales_and_zeros [K / kg, N, 2] (bf16) for groups of kg ∈ {32, 64, 128, 256} consecutive columns:
  Ŵ[n, k] = (u[n, k] - 8) · s[k / kg, n] + zero[k / kg, n]
optkit's integers are signed, q in [qmin, qmax] ⊆ [-8, 7] for bits <= 4, with Ŵ = (q - z) · s, so
  u = q + 8,  s = s,  zero = -z · s   (exact algebra; z · s is rounded once to bf16)
A stored group of g columns becomes g / kg kernel groups with the same scale (g a multiple of kg;
per-channel is g = K). Act-order artifacts (g_idx) whose groups are equal in size are permuted once,
here: the weight's columns sorted by group, and the input's columns gathered the same way per call.
Everything else (groups under 32 columns, N not a multiple of 16, 8-bit weights) returns a reason and
the caller keeps the dequantize-then-matmul reference. Activations are cast to bf16 and the output
back, so the result equals the reference within bf16's precision (~3e-3 relative), not bit for bit.
"""

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes the CPU kernel takes, largest first
# Above this many rows (prompt tokens) dequantizing once into a scratch buffer and running the fp32
# GEMM (PackedIntLinear._dequantize_fast) is faster: the kernel's time grows by a GEMV's per row.
# The two cross near 100 rows of a prefill (docs/results.md, "Numbers moved out of the code").
MAX_KERNEL_ROWS = 96
NAME = "cpu-int4 (aten _weight_int4pack_mm_for_cpu, bf16 activations)"


@dataclass
class Int4Packed:
    weight: torch.Tensor  # uint8 [N, K / 2], the kernel's layout
    scales_and_zeros: torch.Tensor  # bf16 [K / kg, N, 2]
    group_size: int  # kg
    perm: torch.Tensor | None  # long [K]: input columns in the order of the packed weight (act-order)
    in_features: int
    out_features: int


_reference_only = 0  # > 0 inside `reference_only()`


@functools.cache
def _fast_paths_on() -> bool:
    """OPTKIT_CPU_INT4 is not 0 (the dequantize reference everywhere, for A/B runs)."""
    return os.environ.get("OPTKIT_CPU_INT4", "") != "0"


@functools.cache
def aten_kernel_exists() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def available() -> bool:
    """Packed-integer layers may take a CPU kernel (this one or cpu_w4a8's, PackedIntLinear picks)."""
    return _reference_only == 0 and _fast_paths_on()


@contextlib.contextmanager
def reference_only():
    """Packed-integer layers run the dequantize-then-matmul reference inside this block: for checks of an
    artifact's semantics (the compatibility matrix) rather than of this kernel's rounding."""
    global _reference_only
    _reference_only += 1
    try:
        yield
    finally:
        _reference_only -= 1


def contiguous_groups(g_idx: torch.Tensor | None, in_features: int, groups: int) -> tuple[torch.Tensor | None, str]:
    """(perm or None, "") when sorting the columns by group gives `groups` runs of equal length;
    (None, reason) otherwise."""
    size = in_features // groups
    if g_idx is None:
        return None, ""
    g = g_idx.long()
    if torch.equal(g, torch.arange(in_features) // size):
        return None, ""  # act-order stored, but the groups are in order (GPTQ static groups)
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], torch.arange(in_features) // size):
        return None, "act-order groups of unequal size"
    return perm, ""


def pack(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, bits: int, g_idx: torch.Tensor | None = None
) -> Int4Packed | str:
    """The kernel's layout of a signed integer weight q [N, K] with scale / zero_point [N, G]; or
    why the kernel cannot take it."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    if bits > 4:
        return f"{bits}-bit weights (the kernel is 4-bit)"
    if out_features % 16:
        return f"{out_features} output features (not a multiple of 16)"
    if in_features % groups:
        return "groups of unequal size"
    size = in_features // groups
    kernel_group = next((kg for kg in KERNEL_GROUPS if size % kg == 0), None)
    if kernel_group is None:
        return f"group size {size} (the kernel takes multiples of 32)"
    perm, reason = contiguous_groups(g_idx, in_features, groups)
    if reason:
        return reason
    u = q.to(torch.int32) + 8  # [N, K], 0..15
    if perm is not None:
        u = u[:, perm]
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 2)
    repeat = size // kernel_group
    s = scale.float().repeat_interleave(repeat, dim=1)  # [N, K / kg]
    zero = -zero_point.float().repeat_interleave(repeat, dim=1) * s
    scales_and_zeros = torch.stack([s.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K / kg, N, 2]
    return Int4Packed(weight, scales_and_zeros, kernel_group, perm, in_features, out_features)


def int4_linear(x: torch.Tensor, packed: Int4Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) -> [..., N] in x's dtype."""
    shape = x.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, shape[-1])  # the runtime's [T, K] needs no reshape
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2.to(torch.bfloat16).contiguous(), packed.weight, packed.group_size, packed.scales_and_zeros
    )
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y if x.dim() == 2 else y.reshape(*shape[:-1], packed.out_features)
