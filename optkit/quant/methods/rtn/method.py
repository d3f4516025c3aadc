"""Round to nearest: each weight on its own, no calibration data (the math is in math.py)."""

from optkit.plugins import lazy
from optkit.quant.methods import Method, register_method

RTN = register_method(
    Method(
        name="rtn",
        summary="round to nearest, no calibration (weight-only)",
        quantize_weight=lazy("optkit.quant.methods.rtn.math:rtn_quantize"),
    )
)
