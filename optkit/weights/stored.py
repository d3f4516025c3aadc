"""A weight scheme whose stored parameters a format fixes, so that quantizers round onto exactly
what will be written (GGUF's blocks: an fp16 scale `d`, and for Q4_1 an fp16 minimum `m`).

The variant changes two things every quantizer reads through `rtn.minmax_qparams` and
`rtn.round_to_grid`:
- scales are rounded to `scale_dtype`, fp16 (WeightScheme.scale_dtype_for), before any integer is chosen;
- with `float_zero`, an asymmetric group keeps its minimum m, rounded to `scale_dtype`, instead of an
  integer zero point: Ŵ = (q − qmin)·s + m, with q in [qmin, qmax] as usual. m need not lie on the
  grid of s, which an integer zero point would force (llama.cpp's Q4_1: x = q_u·d + m, q_u = q − qmin).
A format hands it to the methods through its `constrain(scheme)`; nothing else builds one.
"""

from typing import Literal

from optkit.weights.schemes import WeightScheme


class StoredScheme(WeightScheme):
    scale_dtype: Literal["float16"] = "float16"
    float_zero: bool = False


def has_float_zero(scheme: WeightScheme) -> bool:
    return isinstance(scheme, StoredScheme) and scheme.float_zero and not scheme.symmetric
