"""FP8 W8A8 (E4M3): weights per output channel, activations FP8 per token (dynamic, the default) or
per tensor from calibration (static), as vLLM serves on Hopper; `smoothquant+fp8` smooths first.
Like w8a8 it reads the `smoothquant` section for its activations (`--act-quant`); the math is in
quant/fp8.py and kernels/fp8.py."""

from optkit.quant.fp8 import FP8_PER_CHANNEL
from optkit.quant.methods import Method, register_method
from optkit.quant.smoothquant_layer import smoothquant_procedure


def _procedure(options, then):
    return smoothquant_procedure(options.smoothquant.model_copy(update={"smooth": False}), "fp8", options.gptq)


FP8 = register_method(
    Method(
        name="fp8",
        summary="FP8 E4M3 weights per channel and activations, no smoothing (smoothquant+fp8 smooths)",
        procedure=_procedure,
        fixed_weights=FP8_PER_CHANNEL,
        activations=lambda options: options.smoothquant.activations,
        formats=("compressed-tensors",),
    )
)
