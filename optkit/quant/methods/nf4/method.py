"""NF4: 4-bit NormalFloat weights with blockwise absmax (block 64 by default), no calibration, written
in bitsandbytes' serialization (`--format bitsandbytes`); `--double-quant` stores the block scales in
8 bits (QLoRA's double quantization). The math is in math.py."""

from optkit.plugins import lazy
from optkit.quant.methods import Method, register_method

NF4 = register_method(
    Method(
        name="nf4",
        summary="4-bit NormalFloat, blockwise absmax, no calibration (bitsandbytes format)",
        quantize_weight=lazy("optkit.quant.methods.nf4.math:nf4_quantize"),
        weight_type="nf4",
        bits=(4,),
        formats=("bitsandbytes",),
    )
)
