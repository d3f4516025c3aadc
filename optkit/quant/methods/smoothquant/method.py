"""SmoothQuant: a smoothing stage that moves activation outliers into the weights; the weights stage
that follows quantizes them with the composition's scheme: int8 per channel, rounded (alone, or
`[smoothquant, rtn]`) or GPTQ-quantized (`[smoothquant, gptq]`), or FP8 (`[smoothquant, fp8]`)."""

from optkit.plugins import lazy
from optkit.quant.activation_options import ACT_QUANT
from optkit.quant.methods import Flag, Method, Workload, register_method
from optkit.quant.methods.smoothquant.options import SmoothQuantOptions
from optkit.weights.schemes import W8_PER_CHANNEL


def _alpha(text: str) -> float | str:
    """--alpha's text: a number, or auto (SmoothQuantOptions names what it accepts)."""
    try:
        return float(text)
    except ValueError:
        return text


def _unused(options: SmoothQuantOptions, composition) -> str | None:
    """Activations set here while another W8A8 method runs alone: it reads its own section."""
    owner = composition.activation_stage
    if options.activations != "dynamic" and owner is not None:
        return (
            f"quantize.smoothquant.activations is read only when smoothquant runs: "
            f"{owner.name} reads quantize.{owner.section}.activations (move it there)"
        )
    return None


def search_bytes(options: SmoothQuantOptions, workload: Workload) -> int:
    """The α search: the inputs of a norm-fed group's first linear for the search samples
    [S, L, hidden] and the block's reference output [S, L, hidden], fp32."""
    samples = min(options.search_samples, workload.num_samples)
    return 4 * samples * workload.seq_len * 2 * workload.hidden_size


SMOOTHQUANT = register_method(
    Method(
        name="smoothquant",
        summary="smoothing, then int8 weights and activations",
        stage="smoothing",
        options=SmoothQuantOptions,
        flags=(Flag("--alpha", "alpha", "SmoothQuant migration strength in [0, 1], or auto.", parse=_alpha), ACT_QUANT),
        smooth=lazy("optkit.quant.methods.smoothquant.step:smoothing_stage"),
        memory=search_bytes,
        fixed_weights=W8_PER_CHANNEL,
        activations=lambda options: options.activations,
        then=("gptq", "rtn", "fp8"),
        implies=("rtn", "w8a8"),
        unused=_unused,
    )
)
