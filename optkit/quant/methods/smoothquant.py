"""SmoothQuant: move activation outliers into the weights, then W8A8; the int8 weights are
rounded (alone, or followed by rtn/w8a8) or GPTQ-quantized (`[smoothquant, gptq]`)."""

from optkit.quant.methods import Method, register_method
from optkit.quant.smoothquant import W8_PER_CHANNEL
from optkit.quant.smoothquant_layer import SmoothQuantOptions, smoothquant_procedure


def _procedure(options, then):
    weights = "gptq" if then is not None and then.name == "gptq" else "rtn"
    return smoothquant_procedure(options.smoothquant, weights, options.gptq)


SMOOTHQUANT = register_method(
    Method(
        name="smoothquant",
        summary="smoothing, then int8 weights and activations",
        stage="smoothing",
        options=SmoothQuantOptions,
        procedure=_procedure,
        fixed_weights=W8_PER_CHANNEL,
        activations=lambda options: options.smoothquant.activations,
        then=("gptq", "rtn"),
        implies=("rtn", "w8a8"),
    )
)
