"""Packed-integer layers (`PackedIntLinear`) on x86-64 CPUs through optkit's own W4A8 kernel (cpu_w4a8.cpp):
llama.cpp's Q4_0 x Q8_0 scheme.

y = x · Ŵᵀ with the activations quantized per row and per block of 32 columns to int8, as ggml's q8_0:
  d[m, b] = max_k |x[m, k]| / 127 over the block,  a[m, k] = round(x[m, k] / d[m, b])  (|x - d·a| <= d / 2)
and int32 dot products of the unsigned weight nibbles u = q + 8 with a: AVX-512 VNNI `vpdpbusd` where the
CPU has it, else AVX2's `vpmaddubsw` + `vpmaddwd`. With Ŵ = (q - z)·s = (u - 8 - z)·s per weight group g:
  y[m, n] = Σ_g s[n, g] · Σ_{b ∈ g} d[m, b] · (u[n, b] · a[m, b])  -  s[n, g]·(8 + z[n, g]) · xs[m, g]
  with xs[m, g] = Σ_{b ∈ g} d[m, b] · Σ_{k ∈ b} a[m, k]
so symmetric and asymmetric zero points cost one multiply-add per group. Groups of any multiple of 32
columns (per-channel too); act-order artifacts with equal groups are permuted once, as cpu_int4.py does.
The weight is repacked at load into tiles of 16 outputs × 32 columns (cpu_w4a8.cpp has the layout), so
each weight block loaded serves every row of the batch: batch 16 and prefill reuse it.

The activation rounding is the price: the output moves by at most Σ_b d[m, b] / 2 · Σ_{k ∈ b} |Ŵ[n, k]|,
and a model's KL divergence to its base by what docs/results.md measures (issue 20).

The C++ is compiled at first use (kernels/cpp_build.py: g++, ninja, OpenMP) into
$OPTKIT_CACHE/kernels, once per machine; a failure (no
compiler, not x86-64, no AVX2) leaves a one-line reason and PackedIntLinear takes PyTorch's int4 kernel.
The instruction set follows cpuid, capped to AVX2 by OPTKIT_CPU_ISA=avx2 or ATEN_CPU_CAPABILITY=avx2
(what `bench/cpu_decode.py --isa avx2` sets). Threads: at::parallel_for, torch.set_num_threads's.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from optkit.kernels import cpp_build, cpu_decode, huge_pages
from optkit.kernels.cpu_int4 import contiguous_groups

SOURCE = Path(__file__).with_name("cpu_w4a8.cpp")
BLOCK, LANES = 32, 16  # columns per activation/weight block; outputs per tile
# The kernel takes every row count (None): a prefill's rows reuse each weight block from registers, and
# int8 dot products outrun fp32's GEMM at every size measured (docs/results.md, issue 20).
MAX_KERNEL_ROWS: int | None = None


@dataclass
class W4A8Packed:
    weight: torch.Tensor  # uint8 [T, K / 32, 256], T = ceil(N / 16)
    params: torch.Tensor  # uint8 [T, G, 48]: bf16 s, int8 c = 8 + z; or float32 [T, G, 2, 16]: s, s · c
    group_size: int
    perm: torch.Tensor | None  # long [K]: input columns in the packed weight's order (act-order)
    in_features: int
    out_features: int


@functools.cache
def _build() -> str:
    """Compile (or find) and load the library; "" when loaded, else why not, in one line."""
    reason = cpp_build.load(SOURCE, "optkit_cpu_w4a8")
    if not reason and torch.ops.optkit_w4a8.cpu_isa() < 1:
        return "this CPU has no AVX2"
    return reason


def unavailable_reason() -> str:
    """An empty string when the kernel runs here; otherwise why not (built once per process)."""
    return _build()


@functools.cache
def selected_isa() -> int:
    """1 (AVX2) or 2 (AVX-512 VNNI): the CPU's best, capped by OPTKIT_CPU_ISA / ATEN_CPU_CAPABILITY=avx2."""
    reason = _build()
    assert not reason, reason  # callers check unavailable_reason() first
    return cpp_build.capped_isa(int(torch.ops.optkit_w4a8.cpu_isa()))


def name() -> str:
    return f"cpu-w4a8 (optkit C++, {cpp_build.ISA_NAMES[selected_isa()]}, int8 activations per 32 columns)"


def pack(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bits: int,
    g_idx: torch.Tensor | None = None,
    compact: bool = True,
) -> W4A8Packed | str:
    """The kernel's layout of a signed integer weight q [N, K] with scale / zero_point [N, G]; or why
    the kernel cannot take it. `compact`: the 3-byte parameters (bf16 scale, int8 8 + z) where every
    scale is a bfloat16 value (optkit writes bf16 scales) and every zero point an integer, else the
    8-byte float32 ones; the same bits either way, fewer bytes to read per call (decode at batch 1 is
    bound by them)."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    if groups < 1 or in_features < 1:
        return f"{groups} groups of {in_features} columns"
    if bits > 4:
        return f"{bits}-bit weights (the kernel is 4-bit)"
    if in_features % groups:
        return "groups of unequal size"
    size = in_features // groups
    if size % BLOCK:
        return f"group size {size} (the kernel takes multiples of {BLOCK})"
    perm, reason = contiguous_groups(g_idx, in_features, groups)
    if reason:
        return reason
    tiles, blocks = -(-out_features // LANES), in_features // BLOCK
    padded = tiles * LANES - out_features  # outputs past N: zero weights, never stored
    u = (q.to(torch.int16) + 8).to(torch.uint8)  # [N, K], 0..15
    if perm is not None:
        u = u[:, perm]
    u = torch.nn.functional.pad(u, (0, 0, 0, padded))
    # column k = 32 b + 8 w + 4 h + j; byte (b, w, lane, j) = u[.., h=0] | u[.., h=1] << 4
    u = u.view(tiles, LANES, blocks, 4, 2, 4)
    byte = u[..., 0, :] | (u[..., 1, :] << 4)  # [T, lane, b, w, j]
    # in 2 MiB pages where Linux gives them: a decode step streams it (kernels/huge_pages.py)
    weight = huge_pages.copy_in(byte.permute(0, 2, 3, 1, 4)).view(tiles, blocks, 256)
    s = scale.float()
    c = 8 + zero_point.float()  # Ŵ = u·s - (8 + z)·s
    if compact and torch.equal(s.bfloat16().float(), s) and torch.equal(c.round(), c):  # both exact
        s16 = torch.nn.functional.pad(s.bfloat16().view(torch.int16), (0, 0, 0, padded))  # [N', G]
        s16 = s16.view(tiles, LANES, groups).transpose(1, 2).contiguous().view(torch.uint8)  # [T, G, 32]
        c8 = torch.nn.functional.pad(c.to(torch.int8), (0, 0, 0, padded)).view(tiles, LANES, groups)
        params = torch.cat([s16, c8.transpose(1, 2).contiguous().view(torch.uint8)], dim=-1)  # [T, G, 48]
    else:
        params = torch.nn.functional.pad(torch.stack([s, s * c], dim=1), (0, 0, 0, 0, 0, padded))  # [N', 2, G]
        params = params.view(tiles, LANES, 2, groups).permute(0, 3, 2, 1)  # [T, G, 2, 16], made contiguous below
    return W4A8Packed(weight, huge_pages.copy_in(params), size, perm, in_features, out_features)


def w4a8_linear(x: torch.Tensor, packed: W4A8Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (any float dtype) -> [..., N] in x's dtype. The op takes any float dtype and layout
    (it converts to contiguous float32 itself: one dispatch rather than two per call)."""
    shape = x.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, shape[-1])
    if packed.perm is not None:
        x2 = x2.index_select(1, packed.perm)
    try:
        y = _linear_op()(x2, packed.weight, packed.params, bias, packed.out_features, packed.group_size, selected_isa())
    except ValueError as e:  # the operator's shape checks (TORCH_CHECK_VALUE)
        raise cpu_decode.shape_error(e) from e
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*shape[:-1], packed.out_features)


@functools.cache
def _linear_op():
    """The op's overload, looked up once (torch.ops' attribute lookups cost ~1 µs a call)."""
    reason = _build()
    assert not reason, reason  # callers check unavailable_reason() first
    return torch.ops.optkit_w4a8.linear.default
