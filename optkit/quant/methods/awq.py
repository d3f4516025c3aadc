"""AWQ: activation-aware scales and clipping, calibrated (the walk is in quant/awq_layer.py)."""

from optkit.quant.awq_layer import AWQOptions, awq_procedure
from optkit.quant.methods import Method, register_method

AWQ = register_method(
    Method(
        name="awq",
        summary="activation-aware scaling and clipping, calibrated (weight-only)",
        options=AWQOptions,
        procedure=lambda options, then: awq_procedure(options.weights, options.awq),
    )
)
