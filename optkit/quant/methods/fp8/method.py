"""FP8 W8A8 (E4M3): weights per output channel, activations FP8 per token (dynamic, the default) or
per tensor from calibration (static: `quantize.fp8.activations`, `--act-quant`), as vLLM serves on
Hopper; `smoothquant+fp8` smooths first. The math is in math.py and kernels/fp8.py."""

from optkit.plugins import lazy
from optkit.quant.activation_options import ACT_QUANT, ActivationOptions
from optkit.quant.methods import Method, register_method
from optkit.weights.schemes import FP8_PER_CHANNEL

FP8 = register_method(
    Method(
        name="fp8",
        summary="FP8 E4M3 weights per channel and activations, no smoothing (smoothquant+fp8 smooths)",
        options=ActivationOptions,
        flags=(ACT_QUANT,),
        quantize_weight=lazy("optkit.quant.methods.fp8.math:fp8_quantize"),
        step=lazy("optkit.quant.methods.fp8.step:fp8_step"),
        fixed_weights=FP8_PER_CHANNEL,
        activations=lambda options: options.activations,
        formats=("compressed-tensors",),
    )
)
