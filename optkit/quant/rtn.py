"""Round-to-nearest quantization: min/max scales per group, then round. Pure tensor math.

Shapes: W is [out_features, in_features]; with G = in_features / group_size groups per row,
scale and zero_point are [out_features, G]. Dequantization: Ŵ[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)],
where g(i) = i // group_size, or g_idx[i] when columns were quantized out of order (GPTQ act-order).
"""

import torch

from optkit.weights.quantized import QuantizedWeight, grouped
from optkit.weights.schemes import WeightScheme


def quantized_range(g: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The range [lo, hi] that min/max quantization covers, per group of g ([..., group_size]):
    the group's min and max, widened to include 0; ±max|w| when symmetric."""
    lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
    if symmetric:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    return lo, hi


def minmax_qparams(
    w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each group from its range (which always includes 0).

    Symmetric: s = max|w| / ((2^b - 1) / 2), z = 0. Asymmetric: s = (max - min) / (2^b - 1),
    z = qmin - round(min / s). The scale is rounded to `scale_dtype` first, so q is computed
    with exactly the scale a loader will read back.
    """
    lo, hi = quantized_range(grouped(w.float(), scheme.group_size_for(w.shape[1])), scheme.symmetric)
    levels = (1 << scheme.bits) - 1
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


def quantize(w: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, scheme: WeightScheme) -> torch.Tensor:
    """q = clamp(round(w / s) + z, qmin, qmax), as int8 [out, in]."""
    group_size = w.shape[1] // scale.shape[1]
    q = torch.round(grouped(w.float(), group_size) / scale.float().unsqueeze(-1))
    q = (q + zero_point.float().unsqueeze(-1)).clamp(scheme.qmin, scheme.qmax)
    return q.reshape(w.shape).to(torch.int8)


def rtn_quantize(w: torch.Tensor, scheme: WeightScheme, scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    scale, zero_point = minmax_qparams(w, scheme, scale_dtype)
    return QuantizedWeight(quantize(w, scale, zero_point, scheme), scale, zero_point, scheme)


def weight_error(w: torch.Tensor, w_hat: torch.Tensor) -> dict[str, float]:
    """Mean squared error and relative Frobenius error ‖W − Ŵ‖ / ‖W‖."""
    diff = w.float() - w_hat.float()
    return {
        "mse": diff.pow(2).mean().item(),
        "rel_error": (diff.norm() / w.float().norm().clamp(min=1e-12)).item(),
    }
