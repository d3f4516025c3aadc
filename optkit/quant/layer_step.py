"""What every method's per-layer step shares: the one per-linear loop and the helpers around it.

A method's step gets a `LayerWork` (calibrate.py walks the layers), may fold scales into the layer
first (a smoothing stage, AWQ's search), then hands the target linears to `quantize_linears`: for
each group, the statistics its `LinearQuantizer` needs (GPTQ's Hessians) and the activation
observer's (a static input scale); for each linear, weight → quantized weight → error against the
weight it rounded → the layer holds the dequantized weight (the next group is calibrated on
quantized outputs) → report. It returns local name -> (QuantizedWeight, stats).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from optkit.quant.activation_observer import StaticInputScale
from optkit.quant.calibrate import LayerProcedure, LayerWork, sequential_groups
from optkit.quant.methods.rtn.math import weight_error
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme

log = logging.getLogger(__name__)

Results = dict[str, tuple[QuantizedWeight, dict]]
# a weights stage on one layer: (work, what a smoothing stage recorded per linear, observer) -> results
WeightsStep = Callable[[LayerWork, dict[str, dict], StaticInputScale | None], Results]


@dataclass(frozen=True)
class LinearQuantizer:
    """How a weights method quantizes one linear of the layer.

    statistics(work, names): what it needs of a group's inputs, one entry per name (None: nothing).
    quantize(work, name, weight, statistic) -> (QuantizedWeight, its stats, the weight it rounded:
    the error is measured against it; AWQ's clipped weight)."""

    quantize: Callable[[LayerWork, str, torch.Tensor, Any], tuple[QuantizedWeight, dict, torch.Tensor]]
    statistics: Callable[[LayerWork, list[str]], dict[str, Any]] | None = None


def quantize_linears(
    work: LayerWork,
    groups: list[list[str]],
    quantizer: LinearQuantizer,
    smoothed: dict[str, dict] | None = None,
    observer: StaticInputScale | None = None,
) -> Results:
    """The per-linear loop: each group's statistics, then each of its linears quantized, measured,
    set into the layer and reported. `smoothed`: the stats a smoothing stage recorded per linear."""
    results: Results = {}
    for group in groups:
        group = [n for n in group if n in work.targets]
        if not group:
            continue
        statistics = quantizer.statistics(work, group) if quantizer.statistics is not None else {}
        observed = observer.observe(work, group) if observer is not None else {}
        for name in group:
            weight = work.layer.get_submodule(name).weight.detach()
            qw, own, reference = quantizer.quantize(work, name, weight, statistics.pop(name, None))
            stats = {"loss": float("nan"), **(smoothed or {}).get(name, {}), **own}
            if name in observed:
                qw.input_scale = observer.input_scale(observed[name])
            stats.update(weight_error(reference.cpu(), qw.dequantize()))
            set_quantized(work, name, qw)
            results[name] = (qw, stats)
            work.report(name, stats)
    return results


def sequential_step(quantizer: LinearQuantizer) -> WeightsStep:
    """A weights step that quantizes the layer's linears in true-sequential groups."""

    def step(work: LayerWork, smoothed: dict[str, dict], observer: StaticInputScale | None) -> Results:
        return quantize_linears(work, sequential_groups(work.layer, work.family), quantizer, smoothed, observer)

    return step


def per_weight_quantizer(quantize_weight: Callable[..., QuantizedWeight], scheme: WeightScheme) -> LinearQuantizer:
    """A data-free quantizer (rtn, fp8) run on calibrated layers: each weight alone, in fp32."""

    def quantize(work: LayerWork, name: str, weight: torch.Tensor, _) -> tuple[QuantizedWeight, dict, torch.Tensor]:
        own = work.scheme_for(name, scheme)
        return quantize_weight(weight, own, own.scale_dtype_for(weight.dtype)), {}, weight

    return LinearQuantizer(quantize)


def layer_procedure(
    smooth: Callable[[LayerWork], dict[str, dict]] | None, step: WeightsStep, observer: StaticInputScale | None
) -> LayerProcedure:
    """A composition on one layer: the smoothing stage (if any), then the weights stage's step."""

    def procedure(work: LayerWork) -> Results:
        return step(work, smooth(work) if smooth is not None else {}, observer)

    return procedure


def too_few_tokens(work: LayerWork, name: str, method: str) -> bool:
    """Whether an expert's linear saw fewer calibration tokens than its threshold (it then gets
    RTN); says so in one warning naming it."""
    minimum = work.min_tokens.get(name)
    if minimum is None or work.tokens_seen.get(name, 0) >= minimum:
        return False
    log.warning(
        "%s.%s: %d calibration tokens reached this expert, fewer than %d: quantized with RTN instead of %s "
        "(more --num-samples, --moe-calibration all, or a lower moe_min_tokens)",
        work.prefix,
        name,
        work.tokens_seen.get(name, 0),
        minimum,
        method,
    )
    return True


def set_quantized(work: LayerWork, name: str, qw: QuantizedWeight) -> None:
    work.layer.get_submodule(name).weight.copy_(qw.dequantize().to(work.device))


def count_tokens(work: LayerWork, names: list[str]) -> None:
    """work.tokens_seen[name]: the calibration tokens that reach each named linear (an expert's,
    in --moe-calibration routed, only those the router sends it)."""
    counts = dict.fromkeys(names, 0)

    def on_input(name: str, x: torch.Tensor, owner: str) -> None:
        counts[name] += x.reshape(-1, x.shape[-1]).shape[0]

    work.run_until_seen(names, on_input)
    work.tokens_seen.update(counts)


def fold_scale(
    layer: torch.nn.Module, previous: str, linears: tuple[str, ...], s: torch.Tensor, norm_offset: float = 0.0
) -> None:
    """W_i ← W_i diag(s) for each linear, and the previous operation's output channels ← / s. A norm
    that scales by (norm_offset + w) (Gemma's 1 + w) gets w ← (norm_offset + w)/s − norm_offset."""
    prev = layer.get_submodule(previous)
    if isinstance(prev, torch.nn.Linear):
        prev.weight.div_(s.view(-1, 1))
        if prev.bias is not None:
            prev.bias.div_(s)
    elif norm_offset:  # y = norm(x) · (offset + weight)
        prev.weight.copy_((prev.weight + norm_offset) / s - norm_offset)
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s)
    else:  # RMSNorm / LayerNorm: y = norm(x) * weight
        prev.weight.div_(s)
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s)
    for name in linears:
        layer.get_submodule(name).weight.mul_(s.view(1, -1))


def block_output(work: LayerWork, block: str, x: torch.Tensor) -> torch.Tensor:
    """The output of `block` (a module of the layer) for inputs x ([S, L, in]), run `batch_size`
    samples at a time like the rest of the calibration: the block's intermediates (the MLP's
    [S, L, intermediate]) never exist for all S samples at once, only its output does."""
    out = None
    for start, y in _block_outputs(work, block, x):
        if out is None:
            out = y.new_empty(x.shape[0], *y.shape[1:])
        out[start : start + y.shape[0]] = y
    return out


def block_error(work: LayerWork, block: str, x: torch.Tensor, reference: torch.Tensor) -> float:
    """mean((block(x) − reference)²), batch by batch: no output-sized temporaries."""
    total = 0.0
    for start, y in _block_outputs(work, block, x):
        total += (y - reference[start : start + y.shape[0]]).pow_(2).sum().item()
    return total / reference.numel()


def sample_errors(work: LayerWork, block: str, x: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """mean((block(x) − reference)²) of each sample of x: [S], batch by batch."""
    errors = []
    for start, y in _block_outputs(work, block, x):
        diff = (y - reference[start : start + y.shape[0]]).pow_(2)
        errors.append(diff.reshape(diff.shape[0], -1).mean(dim=1).cpu())
    return torch.cat(errors)


def _block_outputs(work: LayerWork, block: str, x: torch.Tensor):
    """(first sample, output) for each batch of `work.batch_size` samples of x."""
    module = work.layer.get_submodule(block)
    for start in range(0, x.shape[0], work.batch_size):
        chunk = x[start : start + work.batch_size]
        if block.endswith("self_attn"):
            out = module(hidden_states=chunk, position_embeddings=work.rope, attention_mask=work.attention_mask)
            yield start, out[0]
        else:
            yield start, module(chunk)
