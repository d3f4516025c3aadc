"""Plain W8A8: int8 weights per output channel, rounded to nearest, and int8 activations (dynamic,
or static: `quantize.w8a8.activations`, `--act-quant`), without smoothing: the baseline SmoothQuant
improves on."""

from optkit.plugins import lazy
from optkit.quant.activation_options import ACT_QUANT, ActivationOptions
from optkit.quant.methods import Method, register_method
from optkit.weights.schemes import W8_PER_CHANNEL

W8A8 = register_method(
    Method(
        name="w8a8",
        summary="int8 weights and activations, no smoothing",
        options=ActivationOptions,
        flags=(ACT_QUANT,),
        quantize_weight=lazy("optkit.quant.methods.rtn.math:rtn_quantize"),
        step=lazy("optkit.quant.methods.w8a8.step:w8a8_step"),
        fixed_weights=W8_PER_CHANNEL,
        activations=lambda options: options.activations,
    )
)
