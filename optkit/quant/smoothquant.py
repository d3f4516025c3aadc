"""SmoothQuant (Xiao et al., 2022): move activation outliers into the weights, then W8A8.

Per input channel j of a smoothing group (a norm feeding linears W_1..W_m):
    s_j = max|X_j|^α / max_i,o |W_i[o, j]|^(1−α)                          (paper, eq. 4)
and X ← X diag(s)⁻¹ (folded into the norm), W ← W diag(s): the product is unchanged, while the
activation's channel ranges shrink toward each other and int8 per-token quantization loses less.
Pure tensor functions; the per-layer walk is in smoothquant_layer.py.
"""

import torch

from optkit.kernels.w8a8 import quantize_activations
from optkit.quant.rtn import rtn_quantize
from optkit.weights.schemes import WeightScheme

W8_PER_CHANNEL = WeightScheme(bits=8, group_size=-1, symmetric=True)


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s = max|X_j|^α / max|W_j|^(1−α), per input channel j: [in]."""
    w_absmax = torch.cat([w.float() for w in weights], dim=0).abs().amax(dim=0)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.clamp(min=1e-5).pow(1 - alpha)
    return s.clamp(min=1e-5)


def fake_quantize_weight(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Int8 per output channel, symmetric, dequantized back."""
    return rtn_quantize(w, W8_PER_CHANNEL, scale_dtype).dequantize().to(w.device)


def fake_quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Int8 per token (or per tensor with a static scale), dequantized back; keeps x's shape."""
    q, scale = quantize_activations(x.reshape(-1, x.shape[-1]), input_scale)
    return (q.float() * scale).reshape(x.shape).to(x.dtype)
