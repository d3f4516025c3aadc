"""NF4 (QLoRA's 4-bit NormalFloat): blockwise absmax scaling onto a 16-value code book. Pure tensor math.

Per block of `group_size` columns of a row (bitsandbytes' blocks of 64 consecutive values of the
flattened weight are exactly these when in_features is a multiple of 64):
    absmax_b = max |W_b|,   q = argmin_k |NF4[k] - W / absmax_b|   (ties up, as bitsandbytes),
    Ŵ = NF4[q] · absmax_b.
absmax stays float32 (what bitsandbytes stores). Double quantization (the QLoRA paper's second
quantization of the scales) is applied by the checkpoint format (formats/bitsandbytes.py): it
rounds the absmax values to 8 bits, and readers (optkit's runtime and gate included) use those.
"""

import torch

from optkit.weights.codebooks import dynamic_code, nearest_code, nf4_code
from optkit.weights.quantized import QuantizedWeight, grouped
from optkit.weights.schemes import WeightScheme

NF4_BLOCK64 = WeightScheme(bits=4, group_size=64, symmetric=True, type="nf4")
NESTED_BLOCKSIZE = 256  # bitsandbytes' block size for double quantization of the absmax values


def nf4_quantize(w: torch.Tensor, scheme: WeightScheme = NF4_BLOCK64, scale_dtype: torch.dtype = torch.float32):
    """W [out, in] -> q uint8 [out, in] (codes 0..15), absmax float32 [out, in / group_size].
    scale_dtype is ignored: NF4 block scales are float32, as bitsandbytes keeps them."""
    assert scheme.type == "nf4", scheme
    blocks = grouped(w.float(), scheme.group_size_for(w.shape[1]))  # [out, G, block]
    absmax = blocks.abs().amax(dim=-1)
    scaled = (blocks / absmax.clamp(min=1e-38).unsqueeze(-1)).clamp(-1, 1)
    q = nearest_code(scaled, nf4_code()).reshape(w.shape)
    return QuantizedWeight(q, absmax, torch.zeros(absmax.shape, dtype=torch.int8), scheme)


def double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bitsandbytes' `quantize_4bit(compress_statistics=True)` on the flat absmax values [n]:
    offset = mean, then blockwise (256) 8-bit dynamic quantization of absmax - offset.
    Returns (codes uint8 [n], nested_absmax float32 [ceil(n / 256)], offset float32 [])."""
    flat = absmax.float().reshape(-1)
    offset = flat.mean()
    centered = flat - offset
    pad = -len(centered) % NESTED_BLOCKSIZE
    blocks = torch.nn.functional.pad(centered, (0, pad)).reshape(-1, NESTED_BLOCKSIZE)
    counts = torch.full((blocks.shape[0],), NESTED_BLOCKSIZE)
    counts[-1] -= pad
    nested = blocks.abs().amax(dim=-1)  # the zero padding never raises a block's absmax
    scaled = (blocks * (1.0 / nested.clamp(min=1e-38)).unsqueeze(-1)).clamp(-1, 1)
    codes = nearest_code(scaled, dynamic_code()).reshape(-1)[: len(flat)]
    return codes, nested, offset


def double_dequantize(codes: torch.Tensor, nested: torch.Tensor, offset: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of `double_quantize`: the absmax values a reader uses, float32 `shape`."""
    values = dynamic_code()[codes.long().reshape(-1)]
    block = torch.arange(len(values)) // NESTED_BLOCKSIZE
    return (values * nested.float()[block] + offset.float()).reshape(shape)
