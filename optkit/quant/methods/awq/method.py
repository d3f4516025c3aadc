"""AWQ: activation-aware scales and clipping, calibrated (the math is in math.py, the layer step
in step.py)."""

from optkit.plugins import lazy
from optkit.quant.methods import Method, Workload, register_method
from optkit.quant.methods.awq.options import AWQOptions

awq_step = lazy("optkit.quant.methods.awq.step:awq_step")


def search_bytes(options: AWQOptions, workload: Workload) -> int:
    """The scale search: the inputs of a smoothing group's first linear for the search samples
    [S, L, in] and the block's reference output [S, L, hidden], fp32. AWQ's groups include
    up → down, so `in` is the widest input."""
    widest_in = max((i for _, i in workload.linears.values()), default=0)
    samples = min(options.search_samples, workload.num_samples)
    return 4 * samples * workload.seq_len * (widest_in + workload.hidden_size)


AWQ = register_method(
    Method(
        name="awq",
        summary="activation-aware scaling and clipping, calibrated (weight-only)",
        options=AWQOptions,
        step=lambda options, scheme: awq_step(scheme, options),
        memory=search_bytes,
    )
)
