"""SmoothQuant: move activation outliers into the weights, then W8A8; the int8 weights are
rounded (alone, or followed by rtn/w8a8) or GPTQ-quantized (`[smoothquant, gptq]`), or the
weights and activations are FP8 (`[smoothquant, fp8]`: the weights stage's scheme wins)."""

from optkit.quant.methods import Method, register_method
from optkit.quant.smoothquant import W8_PER_CHANNEL
from optkit.quant.smoothquant_layer import SmoothQuantOptions, smoothquant_procedure


def _procedure(options, then):
    weights = then.name if then is not None and then.name in ("gptq", "fp8") else "rtn"
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
        then=("gptq", "rtn", "fp8"),
        implies=("rtn", "w8a8"),
    )
)
