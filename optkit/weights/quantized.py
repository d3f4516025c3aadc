"""A quantized weight as data: integers, scales, zero points and the scheme, with the one
dequantization every reader and kernel agrees on.

Shapes: q is [out_features, in_features]; with G = in_features / group_size groups per row,
scale and zero_point are [out_features, G]. Dequantization: Ŵ[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)],
where g(i) = i // group_size, or g_idx[i] when columns were quantized out of order (GPTQ act-order).
"""

from dataclasses import dataclass

import torch

from optkit.weights.codebooks import nf4_code
from optkit.weights.schemes import WeightScheme


@dataclass
class QuantizedWeight:
    q: torch.Tensor  # int8 [out, in], values in [scheme.qmin, scheme.qmax]
    scale: torch.Tensor  # [out, G] in the stored dtype
    zero_point: torch.Tensor  # int8 [out, G]; zeros when symmetric
    scheme: WeightScheme
    g_idx: torch.Tensor | None = None  # int32 [in]: group of each input column; None = i // group_size
    input_scale: torch.Tensor | None = None  # W8A8 with static activations: one calibrated scale [1]
    grid: object | None = None  # a K-quant's super-block parameters (weights/kquants.KGrid), for its writer

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if getattr(self.scheme, "type", "int") == "nf4":  # q indexes the NF4 code book, scale is the block's absmax
            return dequantize_codebook(self.q, self.scale, nf4_code()).to(dtype)
        return dequantize(self.q, self.scale, self.zero_point, self.g_idx, self.scheme.qmin).to(dtype)


def dequantize_codebook(q: torch.Tensor, scale: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Ŵ[o, i] = code[q[o, i]] · s[o, i // group_size], in float32 [out, in] (NF4: q in 0..15)."""
    values = code.to(q.device)[q.long()]
    return (grouped(values, q.shape[1] // scale.shape[1]) * scale.float().unsqueeze(-1)).reshape(q.shape)


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] -> [out, G, group_size]."""
    return w.reshape(w.shape[0], -1, group_size)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, g_idx: torch.Tensor | None = None, qmin: int = 0
) -> torch.Tensor:
    """Ŵ = (q - z) * s, in float32 [out, in]. A floating-point zero_point is a stored minimum m
    (weights/stored.py): Ŵ = (q - qmin) * s + m."""
    if zero_point.is_floating_point():
        group_size = q.shape[1] // scale.shape[1]
        columns = g_idx.long() if g_idx is not None else torch.arange(q.shape[1], device=q.device) // group_size
        return (q.float() - qmin) * scale.float()[:, columns] + zero_point.float()[:, columns]
    if g_idx is not None:
        columns = g_idx.long()
        return (q.float() - zero_point.float()[:, columns]) * scale.float()[:, columns]
    group_size = q.shape[1] // scale.shape[1]
    centered = grouped(q.float(), group_size) - zero_point.float().unsqueeze(-1)
    return (centered * scale.float().unsqueeze(-1)).reshape(q.shape)
