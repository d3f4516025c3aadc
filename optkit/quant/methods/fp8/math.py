"""FP8 (E4M3) weights: one scale per output channel, no calibration. Pure tensor math.

sw[o] = max_i |W[o, i]| / 448 (rounded to the stored scale dtype first, so q is computed with exactly
the scale a loader reads back), q = fp8(W / sw) (kernels/fp8.py), Ŵ = q · sw. Activations are
quantized at run time (per token) or with a calibrated per-tensor scale (quant/activation_observer.py).
"""

import torch

from optkit.kernels.fp8 import FP8_MAX, to_fp8
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import FP8_PER_CHANNEL, WeightScheme


def fp8_quantize(
    w: torch.Tensor, scheme: WeightScheme = FP8_PER_CHANNEL, scale_dtype: torch.dtype | None = None
) -> QuantizedWeight:
    """W [out, in] -> float8_e4m3fn q [out, in] and scale [out, 1] (in `scale_dtype`; None: the
    scheme's rule for W's dtype)."""
    assert scheme == FP8_PER_CHANNEL, scheme
    scale_dtype = scheme.scale_dtype_for(w.dtype) if scale_dtype is None else scale_dtype
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = to_fp8(w / scale.float())
    return QuantizedWeight(q, scale, torch.zeros(scale.shape, dtype=torch.int8), scheme)


def fake_quantize_weight(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 per output channel, dequantized back."""
    return fp8_quantize(w, FP8_PER_CHANNEL, scale_dtype).dequantize().to(w.device)
