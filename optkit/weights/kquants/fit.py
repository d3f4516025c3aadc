"""A K-quant grid for a weight: each super-block's d (and dmin) and its quantized sub-scales (and
sub-minimums), fitted as llama.cpp's quantize_row_q*_K_impl does, then the levels on that grid.

Importance: with `importance` (one value ≥ 0 per input column: an importance matrix, or GPTQ's
Hessian diagonal), a weight counts imp·√(σ² + x²), σ² = 2·mean(x²) over its super-block (mean(x²)
for Q2_K), and as imp alone for Q6_K; without it, √σ² + |x| (Q2_K/Q4_K/Q5_K) or x² (Q3_K, Q6_K).
Sub-blocks then get their scale (and minimum) from search.py, and the super-block quantizes them:
  Q2_K, Q4_K, Q5_K: make_qkx3_quants per sub-block, make_qp_quants for d and for dmin (weights Σw)
  Q3_K:             make_qx_quants per sub-block (nmax 4), make_qx_quants for d (nmax 32)
  Q6_K:             make_qx_quants per sub-block (nmax 32), d = max|scale| / 128 (quantize_row_q6_K_impl)
"""

import torch

from optkit.errors import OptkitError
from optkit.weights.kquants import search
from optkit.weights.kquants.layout import QK_K, TYPES, KGrid, KType


def _element_weights(x: torch.Tensor, qtype: str, importance: torch.Tensor | None) -> torch.Tensor:
    """[N, 256] importances of the weights of N super-blocks."""
    if qtype == "Q6_K":
        return importance if importance is not None else x * x
    sigma2 = x.pow(2).mean(dim=-1, keepdim=True) * (1 if qtype == "Q2_K" else 2)
    if importance is not None:
        return importance * torch.sqrt(sigma2 + x * x)
    return x * x if qtype == "Q3_K" else torch.sqrt(sigma2) + x.abs()


def _nonzero(w: torch.Tensor) -> torch.Tensor:
    """A group whose importances are all 0 counts every weight alike (else its scale would be 0)."""
    return torch.where(w.sum(dim=-1, keepdim=True) > 0, w, torch.ones_like(w))


def _half(d: torch.Tensor, what: str) -> torch.Tensor:
    half = d.to(torch.float16)
    if not torch.isfinite(half).all():
        raise OptkitError(f"a weight is too large for a K-quant's fp16 super-block {what}: repair the checkpoint")
    return half


def fit_grid(weight: torch.Tensor, qtype: str, importance: torch.Tensor | None = None) -> KGrid:
    """The super-block parameters of weight [R, C] (C a multiple of 256); importance [C] or None."""
    kind = TYPES[qtype]
    rows, cols = weight.shape
    x = weight.float().reshape(-1, QK_K)  # [N, 256], N = R·C/256 super-blocks
    imp = None if importance is None else importance.float().to(x.device).reshape(1, -1).expand(rows, -1)
    w = _element_weights(x, qtype, None if imp is None else imp.reshape(-1, QK_K))
    sub_x = x.reshape(-1, kind.sub)
    sub_w = _nonzero(w.reshape(-1, kind.sub))
    sw = _nonzero(sub_w.sum(dim=-1).reshape(-1, kind.subs))  # [N, subs]
    if not kind.symmetric:
        grid = _affine_grid(sub_x, sub_w, sw, kind)
    elif qtype == "Q3_K":
        scales = search.signed_levels(sub_x, sub_w, 1 << (kind.bits - 1))[0].reshape(-1, kind.subs)
        d, sc = search.signed_levels(scales, sw, 32)
        grid = KGrid(_half(d, "scale"), sc.to(torch.int16))
    else:
        grid = _q6_grid(search.signed_levels(sub_x, sub_w, 32)[0].reshape(-1, kind.subs))
    blocks = cols // QK_K
    return KGrid(
        grid.d.reshape(rows, blocks),
        grid.sc.reshape(rows, -1),
        None if grid.dmin is None else grid.dmin.reshape(rows, blocks),
        None if grid.m is None else grid.m.reshape(rows, -1),
    )


def _affine_grid(sub_x: torch.Tensor, sub_w: torch.Tensor, sw: torch.Tensor, kind: KType) -> KGrid:
    scale, minimum = search.affine_levels(sub_x, sub_w, (1 << kind.bits) - 1, -0.9, 0.05, 36)
    scale = scale.clamp(min=0).reshape(sw.shape)
    minimum = minimum.clamp(min=0).reshape(sw.shape)
    d, sc = search.positive_levels(scale, sw, kind.sc_max)
    dmin, m = search.positive_levels(minimum, sw, kind.sc_max)
    return KGrid(_half(d, "scale"), sc.to(torch.int16), _half(dmin, "minimum"), m.to(torch.int16))


def _q6_grid(scales: torch.Tensor) -> KGrid:
    """Q6_K's int8 sub-scales: iscale = −128 / (the sub-scale of largest magnitude)."""
    peak = scales.gather(-1, scales.abs().argmax(dim=-1, keepdim=True))
    zero = peak.abs() < search.GROUP_MAX_EPS
    iscale = -128 / torch.where(zero, torch.ones_like(peak), peak)
    sc = torch.round(iscale * scales).clamp(-128, 127)
    d = torch.where(zero, torch.zeros_like(peak), 1 / iscale).squeeze(-1)
    return KGrid(_half(d, "scale"), torch.where(zero, 0, sc).to(torch.int16))


def round_levels(weight: torch.Tensor, grid: KGrid, qtype: str) -> torch.Tensor:
    """The nearest level of each weight on `grid`: uint8 [R, C] in 0 .. 2^bits − 1. A sub-block
    whose scale is 0 gets level 0 (ggml skips it; it dequantizes to its offset either way)."""
    kind = TYPES[qtype]
    rows, cols = weight.shape
    x = weight.float().reshape(rows, -1, kind.sub)
    scale = grid.scales().to(x.device).unsqueeze(-1)
    scale = scale.masked_fill(scale == 0, float("inf"))
    if kind.symmetric:
        half = 1 << (kind.bits - 1)
        q = torch.round(x / scale).clamp(-half, half - 1) + half
    else:
        q = torch.round((x - grid.zeros().to(x.device).unsqueeze(-1)) / scale).clamp(0, (1 << kind.bits) - 1)
    return q.to(torch.uint8).reshape(rows, cols)
