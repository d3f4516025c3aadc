"""FP8 W8A8 (E4M3): weights per output channel, activations FP8 per token (dynamic, the default) or
per tensor from calibration (static: `quantize.fp8.activations`, `--act-quant`), as vLLM serves on
Hopper; `smoothquant+fp8` smooths first. The math is in math.py and kernels/fp8.py."""

from optkit.quant.activation_observer import ACT_QUANT, ActivationOptions
from optkit.quant.layer_step import per_weight_step
from optkit.quant.methods import Method, register_method
from optkit.quant.methods.fp8.math import FP8_PER_CHANNEL, fp8_quantize

FP8 = register_method(
    Method(
        name="fp8",
        summary="FP8 E4M3 weights per channel and activations, no smoothing (smoothquant+fp8 smooths)",
        options=ActivationOptions,
        flags=(ACT_QUANT,),
        quantize_weight=fp8_quantize,
        step=per_weight_step(fp8_quantize),
        fixed_weights=FP8_PER_CHANNEL,
        activations=lambda options: options.activations,
        formats=("compressed-tensors",),
    )
)
