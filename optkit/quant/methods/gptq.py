"""GPTQ: error-compensating rounding from the layer's Hessian (the math is in quant/gptq.py)."""

from optkit.quant.gptq import GPTQOptions
from optkit.quant.methods import Method, register_method
from optkit.quant.procedures import gptq_procedure


def _act_order(options: GPTQOptions) -> bool | str:
    """How the format must describe the column order: False, "group" (g_idx) or "weight"."""
    if not options.act_order:
        return False
    return "weight" if options.static_groups else "group"


def _unused(options: GPTQOptions) -> str | None:
    if options.act_order or options.static_groups:
        return "act_order and static_groups are GPTQ options: use them with method gptq (--method gptq)"
    return None


GPTQ = register_method(
    Method(
        name="gptq",
        summary="Hessian-aware rounding, calibrated (weight-only)",
        options=GPTQOptions,
        procedure=lambda options, then: gptq_procedure(options.weights, options.gptq),
        act_order=_act_order,
        unused=_unused,
    )
)
