"""NF4 linear layers: 4-bit code-book indices stay packed in memory, looked up and scaled per block
on the fly for each matmul.

Storage: the 4-bit codes c (0..15) in int32 words along the input dimension, column 8w + j at bits 4j
of word w (the 4-bit layout of optkit/kernels/packed_int.py); absmax per (row, block) float32.
Dequantization: Ŵ[o, i] = NF4[c[o, i]] · absmax[o, i // block], in float32 exactly as
`QuantizedWeight.dequantize` computes it. On CUDA the W4A16 Triton kernel runs it (its code-book
mode: a 16-entry table lookup instead of q - z); everywhere else, dequantize then matmul.
"""

import torch
import torch.nn.functional as F

from optkit.kernels import triton as triton_kernels  # imports triton only once a CUDA tensor asks
from optkit.kernels.packed_int import check_layer_tensors
from optkit.weights.codebooks import nf4_code
from optkit.weights.packing import pack_int32, unpack_int32
from optkit.weights.quantized import QuantizedWeight, dequantize_codebook


class NF4Linear(torch.nn.Module):
    """y = x Ŵᵀ + b with Ŵ = NF4[c] · absmax dequantized at each call."""

    bits = 4

    def __init__(self, qweight: torch.Tensor, absmax: torch.Tensor, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        zero_point = torch.zeros(absmax.shape, dtype=torch.int8)  # the W4A16 kernel's view: no zero point
        check_layer_tensors(qweight, absmax, zero_point, 4, in_features, None, bias)
        self.in_features, self.out_features = in_features, absmax.shape[0]
        self.register_buffer("qweight", qweight)  # int32 [out, ceil(in / 8)], codes 0..15
        self.register_buffer("scale", absmax.float())  # [out, in / block]
        self.register_buffer("codebook", nf4_code().clone())  # [16]
        self.register_buffer("bias", bias)
        self.register_buffer("zero_point", zero_point, persistent=False)  # and contiguous blocks
        self.g_idx = None

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> "NF4Linear":
        assert getattr(qw.scheme, "type", "int") == "nf4", qw.scheme
        return cls(pack_int32(qw.q.to(torch.int64), 4), qw.scale, qw.q.shape[1], bias)

    def codes(self) -> torch.Tensor:
        """The code-book indices c [out, in], int32."""
        return unpack_int32(self.qweight, 4, self.in_features)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_codebook(self.codes(), self.scale, self.codebook).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        y = triton_kernels.packed_linear(self, x, bias)
        return y if y is not None else F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        block = self.in_features // self.scale.shape[1]
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4, blocks of {block}"
