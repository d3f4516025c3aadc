"""A weight scheme whose stored parameters a format fixes, so that quantizers round onto exactly
what will be written (GGUF's blocks: an fp16 scale `d`, and for Q4_1 an fp16 minimum `m`).

The variant changes two things every quantizer reads through `rtn.minmax_qparams` and
`rtn.round_to_grid`:
- scales are rounded to `scale_dtype`, fp16 (WeightScheme.scale_dtype_for), before any integer is chosen;
- with `float_zero`, an asymmetric group keeps its minimum m, rounded to `scale_dtype`, instead of an
  integer zero point: Ŵ = (q − qmin)·s + m, with q in [qmin, qmax] as usual. m need not lie on the
  grid of s, which an integer zero point would force (llama.cpp's Q4_1: x = q_u·d + m, q_u = q − qmin).
With `gguf_type` one of ggml's K-quants (weights/kquants), the scales and zero points are the
super-block's float32 products d·sc_j and −dmin·m_j instead, fitted by kquants.fit_grid: the
methods ask `k_type(scheme)` and quantize onto that grid (`k_scheme` builds the scheme for a type).
A format hands it to the methods through its `constrain(scheme)`; nothing else builds one.
"""

from typing import Literal

from pydantic import Field, field_validator

from optkit.weights.kquants import K_TYPES, TYPES
from optkit.weights.schemes import SUPPORTED_BITS, WeightScheme


class StoredScheme(WeightScheme):
    scale_dtype: Literal["float16"] = "float16"
    float_zero: bool = False
    gguf_type: Literal[K_TYPES] | None = Field(None, exclude_if=lambda t: t is None)

    @field_validator("bits")
    @classmethod
    def _bits_supported(cls, bits: int) -> int:
        """The K-quants add 5 and 6 bits (Q5_K, Q6_K) to the integer widths."""
        if bits not in (*SUPPORTED_BITS, 5, 6):
            raise ValueError(f"bits must be one of {(*SUPPORTED_BITS, 5, 6)}, got {bits}")
        return bits

    def scale_dtype_for(self, weight_dtype):
        import torch

        return torch.float32 if self.gguf_type is not None else super().scale_dtype_for(weight_dtype)


def has_float_zero(scheme: WeightScheme) -> bool:
    return isinstance(scheme, StoredScheme) and scheme.float_zero and not scheme.symmetric


def k_type(scheme: WeightScheme) -> str | None:
    """The K-quant a scheme stores (Q4_K, ...), or None."""
    return scheme.gguf_type if isinstance(scheme, StoredScheme) else None


def k_scheme(qtype: str) -> StoredScheme:
    """The scheme of one K type: its level width, sub-block and symmetry."""
    kind = TYPES[qtype]
    return StoredScheme(
        bits=kind.bits, group_size=kind.sub, symmetric=kind.symmetric, float_zero=not kind.symmetric, gguf_type=qtype
    )
