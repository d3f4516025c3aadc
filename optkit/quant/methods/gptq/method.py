"""GPTQ: error-compensating rounding from the layer's Hessian (the math is in math.py, the layer
step in step.py)."""

from optkit.plugins import lazy
from optkit.quant.methods import Flag, Method, Workload, register_method
from optkit.quant.methods.gptq.options import GPTQOptions

gptq_step = lazy("optkit.quant.methods.gptq.step:gptq_step")


def _act_order(options: GPTQOptions) -> bool | str:
    """How the format must describe the column order: False, "group" (g_idx) or "weight"."""
    if not options.act_order:
        return False
    return "weight" if options.static_groups else "group"


def _unused(options: GPTQOptions, composition) -> str | None:
    if options.act_order or options.static_groups:
        return "act_order and static_groups are GPTQ options: use them with method gptq (--method gptq)"
    return None


def _resolve(section: GPTQOptions, options) -> GPTQOptions:
    """Settings left unset take the format's defaults (GGUF Q4_0: act-order, static groups and
    llama.cpp's scale rule) when GPTQ runs, else the plain ones: what is recorded is what ran."""
    from optkit.quant.formats import get_format

    defaults = getattr(get_format(options.format), "gptq_defaults", None)
    return section.resolved(defaults(options.weights) if defaults and options.composition.uses("gptq") else None)


def hessian_elements(workload: Workload) -> int:
    """fp32 elements of the Hessians GPTQ holds at once: those of one true-sequential group, one
    [in, in] per distinct input (q/k/v share the attention's input, an expert's gate and up share
    theirs: the same module path but the last name, the same width), all captured before the
    first is used; plus the factor of (H + λI)⁻¹ that gptq_quantize builds for one linear."""
    worst = 0
    for prefix, groups in workload.layers:
        for group in groups:
            shapes = {n: workload.linears[f"{prefix}.{n}"] for n in group}
            inputs = {(n.rpartition(".")[0], i) for n, (_, i) in shapes.items()}
            widest = max(i for _, i in shapes.values())
            worst = max(worst, sum(i * i for _, i in inputs) + widest * widest)
    return worst


GPTQ = register_method(
    Method(
        name="gptq",
        summary="Hessian-aware rounding, calibrated (weight-only)",
        options=GPTQOptions,
        flags=(
            Flag("--damp", "damp", "GPTQ dampening, a fraction of the mean Hessian diagonal (default 0.01).", float),
            Flag("--block-size", "block_size", "GPTQ lazy-batch block size (default 128).", int),
            Flag(
                "--act-order/--no-act-order",
                "act_order",
                "GPTQ: quantize columns by descending Hessian diagonal (default: off; on for GGUF Q4_0).",
                bool,
            ),
            Flag(
                "--static-groups/--no-static-groups",
                "static_groups",
                "GPTQ: fix group parameters before reordering (default: off; on for GGUF Q4_0).",
                bool,
            ),
        ),
        step=lambda options, scheme: gptq_step(scheme, options),
        memory=lambda options, workload: 4 * hessian_elements(workload),
        act_order=_act_order,
        unused=_unused,
        resolve=_resolve,
    )
)
