"""Plain W8A8: int8 weights per output channel and int8 activations, without smoothing (the
baseline SmoothQuant improves on). It reads the `smoothquant` section for its activations."""

from optkit.quant.methods import Method, register_method
from optkit.quant.smoothquant import W8_PER_CHANNEL
from optkit.quant.smoothquant_layer import smoothquant_procedure


def _procedure(options, then):
    return smoothquant_procedure(options.smoothquant.model_copy(update={"smooth": False}), "rtn", options.gptq)


W8A8 = register_method(
    Method(
        name="w8a8",
        summary="int8 weights and activations, no smoothing",
        procedure=_procedure,
        fixed_weights=W8_PER_CHANNEL,
        activations=lambda options: options.smoothquant.activations,
    )
)
