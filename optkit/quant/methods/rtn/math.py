"""Round-to-nearest quantization: min/max scales per group, then round. Pure tensor math.

Shapes: W is [out_features, in_features]; with G = in_features / group_size groups per row,
scale and zero_point are [out_features, G]. Dequantization: Ŵ[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)],
where g(i) = i // group_size, or g_idx[i] when columns were quantized out of order (GPTQ act-order).
"""

import torch

from optkit.weights import kquants
from optkit.weights.quantized import QuantizedWeight, grouped
from optkit.weights.schemes import WeightScheme
from optkit.weights.stored import has_float_zero, k_type


def quantized_range(g: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The range [lo, hi] that min/max quantization covers, per group of g ([..., group_size]):
    the group's min and max, widened to include 0; ±max|w| when symmetric."""
    lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
    if symmetric:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    return lo, hi


def minmax_qparams(
    w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each group from its range (which always includes 0).

    Symmetric: s = max|w| / ((2^b - 1) / 2), z = 0. Asymmetric: s = (max - min) / (2^b - 1),
    z = qmin - round(min / s). The scale is rounded to `scale_dtype` first, so q is computed
    with exactly the scale a loader will read back (None: the scheme's rule for w's dtype,
    WeightScheme.scale_dtype_for). With a float zero point (weights/stored.py) the group's own
    range is used (no need to contain 0) and z is its minimum m, rounded like the scale.
    """
    scale_dtype = scheme.scale_dtype_for(w.dtype) if scale_dtype is None else scale_dtype
    g = grouped(w.float(), scheme.group_size_for(w.shape[1]))
    levels = (1 << scheme.bits) - 1
    if has_float_zero(scheme):
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        scale = (hi - lo) / levels
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
        return scale, lo.to(scale_dtype)
    lo, hi = quantized_range(g, scheme.symmetric)
    if scheme.symmetric:
        scale = hi / (levels / 2)
    else:
        scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
    if scheme.symmetric:
        zero_point = torch.zeros_like(scale, dtype=torch.int8)
    else:
        zero_point = (scheme.qmin - torch.round(lo / scale.float())).clamp(scheme.qmin, scheme.qmax)
        zero_point = zero_point.to(torch.int8)
    return scale, zero_point


def signed_max_qparams(
    w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric scales by llama.cpp's Q4_0 rule (quantize_row_q4_0_ref): d = m / qmin, m the group's
    value of largest magnitude with its sign, so m lands exactly on qmin (−8) and the other side of
    the grid reaches qmax·|d| (7/8 of |m|). d is negative when m is positive; Ŵ = q·d either way.
    minmax_qparams' s = max|w| / 7.5 instead rounds ±max|w| to a level 0.5·s away on one side."""
    scale_dtype = scheme.scale_dtype_for(w.dtype) if scale_dtype is None else scale_dtype
    g = grouped(w.float(), scheme.group_size_for(w.shape[1]))
    m = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    scale = m / scheme.qmin
    scale = torch.where(scale != 0, scale, torch.ones_like(scale)).to(scale_dtype)
    return scale, torch.zeros_like(scale, dtype=torch.int8)


def round_to_grid(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """The integer nearest to w on the grid of (s, z), broadcast elementwise, as float:
    q = clamp(round(w / s) + z, qmin, qmax); with a float zero point (the minimum m),
    q = clamp(round((w − m) / s), 0, 2^b − 1) + qmin. A scale of 0 (a K-quant's sub-scale 0) rounds to
    level 0 (q = qmin with a float zero, else q = z)."""
    s = s.float()
    s = s.masked_fill(s == 0, float("inf"))
    if z.is_floating_point():
        return torch.clamp(torch.round((w - z.float()) / s), 0, scheme.qmax - scheme.qmin) + scheme.qmin
    return torch.clamp(torch.round(w / s) + z.float(), scheme.qmin, scheme.qmax)


def from_grid(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """Ŵ for q on the grid of (s, z), elementwise: (q − z)·s, or (q − qmin)·s + m with a float zero point."""
    if z.is_floating_point():
        return (q - scheme.qmin) * s.float() + z.float()
    return (q - z.float()) * s.float()


def quantize(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """q = clamp(round(w / s) + z, qmin, qmax) (see `round_to_grid`), as int8 [out, in]."""
    group_size = w.shape[1] // scale.shape[1]
    q = round_to_grid(grouped(w.float(), group_size), scale.unsqueeze(-1), zero_point.unsqueeze(-1), scheme)
    return q.reshape(w.shape).to(torch.int8)


def rtn_quantize(w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype | None = None) -> QuantizedWeight:
    if k_type(scheme) is not None:
        return k_quantize(w, scheme)
    scale, zero_point = minmax_qparams(w, scheme, scale_dtype)
    return QuantizedWeight(quantize(w, scale, zero_point, scheme), scale, zero_point, scheme)


def k_quantize(w: torch.Tensor, scheme: WeightScheme, importance: torch.Tensor | None = None) -> QuantizedWeight:
    """W on the K-quant grid of its scheme (weights/kquants), fitted as llama.cpp does, with
    `importance` [in] weighting each column's errors (None: llama.cpp's weighting without one)."""
    q_u, grid = kquants.quantize_levels(w, k_type(scheme), importance)
    return kquants.quantized_weight(q_u, grid, scheme)


def weight_error(w: torch.Tensor, w_hat: torch.Tensor) -> dict[str, float]:
    """Mean squared error and relative Frobenius error ‖W − Ŵ‖ / ‖W‖."""
    diff = w.float() - w_hat.float()
    return {
        "mse": diff.pow(2).mean().item(),
        "rel_error": (diff.norm() / w.float().norm().clamp(min=1e-12)).item(),
    }
