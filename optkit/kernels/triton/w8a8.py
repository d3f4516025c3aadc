"""Triton W8A8: per-token int8 quantization of the activations, then int8 × int8 → int32 on the
tensor cores with the scales and the bias applied in the epilogue.

Same math as `optkit.kernels.w8a8.int8_linear` (its docstring):
  sx[m] = max(max_k |x[m, k]| / 127, 1e-12) (or the static scale), qx = clamp(round(x / sx), -128, 127),
  y[m, n] = (float(Σ_k qx[m, k] · qw[k, n]) · sx[m]) · sw[n] + b[n], cast to x's dtype.
The division is IEEE (div_rn) and rounding is half to even, as torch.round, so qx and sx equal the
reference's bit for bit; the int32 sums are exact, so the outputs agree up to float32 rounding.
The weight is read through its strides: W8A8Linear's [K, N] row-major `weight_t`, or a [N, K]
row-major weight passed as its transpose (K-major, what Hopper's int8 MMA prefers).
For small M, K is split across programs; int32 partials are summed exactly by the epilogue kernel.
"""

import torch
import triton
import triton.language as tl

from optkit.kernels.triton import _interpreter, next_pow2, num_sms  # noqa: F401 (interpreter fixes)

INT8_MAX = 127


@triton.jit
def _round_half_even(v):
    """torch.round for |v| < 2^23, from floor alone (no libdevice, so it also runs in the interpreter)."""
    f = tl.floor(v)
    diff = v - f  # exact
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((diff > 0.5) | ((diff == 0.5) & odd), f + 1.0, f)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_scale_ptr, K, stride_xm, stride_qm,
                          STATIC: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    m = tl.program_id(0)
    x_row = x_ptr + m * stride_xm
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.div_rn(tl.max(amax, 0), 127.0), 1e-12)
    tl.store(scale_ptr + m, scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.div_rn(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32), scale)
        v = _round_half_even(tl.minimum(tl.maximum(v, -128.0), 127.0))  # clamp first: the same for integer bounds
        tl.store(q_ptr + m * stride_qm + k, v.to(tl.int8), mask=k < K)


@triton.jit
def _epilogue(acc, out_ptr, sx_ptr, sw_ptr, bias_ptr, rows, n, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """acc int32 [BM, BN] -> (acc · sx) · sw + b, in the reference's order, stored in out's dtype."""
    sx = tl.load(sx_ptr + rows, mask=rows < M, other=0.0)
    sw = tl.load(sw_ptr + n, mask=n < N, other=0.0)
    y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & (n < N)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_mm_kernel(
    out_ptr, part_ptr, a_ptr, b_ptr, sx_ptr, sw_ptr, bias_ptr, M, N, K, stride_am, stride_bk, stride_bn, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k = k0 + kk
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + k[None, :], mask=(rows < M)[:, None] & (k < K)[None, :], other=0
        )
        b_ptrs = b_ptr + k[:, None] * stride_bk + n[None, :] * stride_bn
        b = tl.load(b_ptrs, mask=(k < K)[:, None] & (n < N)[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    if SPLIT_K == 1:
        _epilogue(acc, out_ptr, sx_ptr, sw_ptr, bias_ptr, rows, n, M, N, stride_om, HAS_BIAS)
    else:  # int32 partials [SPLIT_K, M, N]: summed exactly by _sum_splits_kernel
        mask = (rows < M)[:, None] & (n < N)[None, :]
        tl.store(part_ptr + (pid_k * M + rows[:, None]) * N + n[None, :], acc, mask=mask)


@triton.jit
def _sum_splits_kernel(out_ptr, part_ptr, sx_ptr, sw_ptr, bias_ptr, M, N, stride_om,
                       HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) + tl.arange(0, 1)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([1, BLOCK_N], tl.int32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (split * M + rows[:, None]) * N + n[None, :], mask=(n < N)[None, :], other=0)
    _epilogue(acc, out_ptr, sx_ptr, sw_ptr, bias_ptr, rows, n, M, N, stride_om, HAS_BIAS)


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], scale [M, 1] fp32), as `optkit.kernels.w8a8.quantize_activations`."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        static = input_scale is not None
        _quantize_rows_kernel[(rows,)](
            x, q, scale, input_scale.float() if static else scale, k, x.stride(0), q.stride(0),
            STATIC=static, BLOCK_K=min(4096, max(16, next_pow2(k))),
        )  # fmt: skip
    return q, scale


def _choose(rows: int, n: int, k: int, device: torch.device) -> dict:
    if rows <= 16:
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    elif rows <= 64:
        config = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    else:
        config = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    tiles = triton.cdiv(rows, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    split = max(1, min(2 * num_sms(device) // tiles, triton.cdiv(k, config["BLOCK_K"]) // 2, 16))
    return config | {"SPLIT_K": 1 << (split.bit_length() - 1)}


def int8_linear(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    **overrides,
) -> torch.Tensor:
    """x [..., K] float; weight_t int8 [K, N] (any strides); weight_scale [N] -> [..., N] in x's dtype."""
    shape, (k, n) = x.shape, weight_t.shape
    assert shape[-1] == k and weight_t.dtype == torch.int8, (shape, weight_t.shape, weight_t.dtype)
    qx, sx = quantize_activations(x.reshape(-1, k), input_scale)
    rows = qx.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out.reshape(*shape[:-1], n)
    config = _choose(rows, n, k, x.device) | overrides
    split = config["SPLIT_K"]
    part = out if split == 1 else torch.empty(split, rows, n, dtype=torch.int32, device=x.device)
    sw = weight_scale.reshape(-1).float().contiguous()
    bias = None if bias is None else bias.contiguous()
    grid = (triton.cdiv(rows, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]), split)
    _int8_mm_kernel[grid](
        out, part, qx, weight_t, sx, sw, out if bias is None else bias, rows, n, k,
        qx.stride(0), weight_t.stride(0), weight_t.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, **config,
    )  # fmt: skip
    if split > 1:
        block_n = min(1024, next_pow2(n))
        _sum_splits_kernel[(rows, triton.cdiv(n, block_n))](
            out, part, sx, sw, out if bias is None else bias, rows, n, out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_N=block_n,
        )  # fmt: skip
    return out.reshape(*shape[:-1], n)
