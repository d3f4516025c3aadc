"""Round to nearest: each weight on its own, no calibration data (the math is in math.py)."""

from optkit.quant.methods import Method, register_method
from optkit.quant.methods.rtn.math import rtn_quantize

RTN = register_method(
    Method(name="rtn", summary="round to nearest, no calibration (weight-only)", quantize_weight=rtn_quantize)
)
