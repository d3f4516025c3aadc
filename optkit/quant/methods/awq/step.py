"""AWQ on one decoder layer: search each smoothing group's scales on the block's output, fold
them, then clip and quantize each linear through the per-linear loop (the math is in math.py)."""

import torch

from optkit.families import expand_smoothing_groups, log_unsmoothable
from optkit.quant.activation_observer import StaticInputScale
from optkit.quant.calibrate import LayerWork, capture_inputs, sequential_groups
from optkit.quant.layer_step import (
    LinearQuantizer,
    Results,
    WeightsStep,
    block_error,
    block_output,
    count_tokens,
    fold_scale,
    quantize_linears,
    too_few_tokens,
)
from optkit.quant.methods.awq import math as awq
from optkit.quant.methods.awq.options import AWQOptions
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme

BLOCKS = ("self_attn.", "mlp.")  # scale, then quantize, one block after the other
QK = ("self_attn.q_proj", "self_attn.k_proj")  # AutoAWQ does not clip them: their errors meet in q·kᵀ


def awq_groups(work: LayerWork):
    """The smoothing groups that apply to this layer (the family's, families/): present, all
    linears targeted, shapes fold."""
    present = [n for n, _ in work.layer.named_modules()]
    for previous, linears, block in expand_smoothing_groups(work.family.smoothing_groups, present):
        try:
            prev = work.layer.get_submodule(previous)
            modules = [work.layer.get_submodule(n) for n in linears]
        except AttributeError:
            continue
        width = prev.out_features if isinstance(prev, torch.nn.Linear) else prev.weight.shape[0]
        enough = all(work.tokens_seen.get(n, 0) >= work.min_tokens[n] for n in linears if n in work.min_tokens)
        if enough and all(n in work.targets for n in linears) and all(m.in_features == width for m in modules):
            yield previous, linears, block


def search_scale(
    work: LayerWork, scheme: WeightScheme, options: AWQOptions, group: tuple[str, tuple[str, ...], str]
) -> dict:
    """The scales of one smoothing group with the lowest block output error after quantization,
    folded into the group; returns the search's stats (loss, alpha, duo_scaling)."""
    previous, linears, block = group
    duo = {"both": (False, True), "on": (True,), "off": (False,)}[options.duo_scaling]
    # an expert's inputs weighted by its router (capture_inputs): only where the compared block
    # is the linear itself (an expert's down projection), as the weighting holds for a linear
    linear_block = block in linears
    x = capture_inputs(work, [linears[0]], options.search_samples, weighted=linear_block)[linears[0]]
    modules = [work.layer.get_submodule(n) for n in linears]
    originals = [m.weight.detach().clone() for m in modules]
    reference = block_output(work, block, x)
    x_mag = awq.activation_magnitude(x)
    schemes = [work.scheme_for(n, scheme) for n in linears]  # a K mix may raise one (attn_v)
    w_mag = awq.weight_magnitude(originals, schemes[0])
    best = {"loss": float("inf")}
    for alpha, use_duo, s in awq.candidate_scales(x_mag, w_mag, options.grid, duo):
        for module, w, own in zip(modules, originals, schemes, strict=True):
            module.weight.copy_(awq.fake_quantize(w * s, own) / s)
        loss = block_error(work, block, x, reference)
        if loss < best["loss"]:
            best = {"loss": loss, "alpha": alpha, "duo_scaling": use_duo, "s": s}
    for module, w in zip(modules, originals, strict=True):
        module.weight.copy_(w)
    fold_scale(work.layer, previous, linears, best.pop("s"), work.family.norm_weight_offset)
    return best


def clipping_quantizer(scheme: WeightScheme, options: AWQOptions) -> LinearQuantizer:
    """Clip each linear's groups where that lowers its output error, then round to nearest."""

    def clip_inputs(work: LayerWork, names: list[str]) -> dict[str, torch.Tensor]:
        if not options.clip:
            return {}
        samples = min(options.search_samples, work.hidden.shape[0])  # only the tokens the search uses
        rows = awq.clip_rows(samples * work.hidden.shape[1], options.clip_tokens)
        return capture_inputs(work, names, samples, rows, weighted=True)

    def quantize(work: LayerWork, name: str, weight: torch.Tensor, x) -> tuple[QuantizedWeight, dict, torch.Tensor]:
        weight, own = weight.clone(), work.scheme_for(name, scheme)
        stats = {}
        if name in work.min_tokens:
            stats["calibration_tokens"] = work.tokens_seen[name]
            if too_few_tokens(work, name, "AWQ"):
                stats["fallback"] = "rtn"
        if options.clip and (options.clip_qk or name not in QK) and "fallback" not in stats:
            bounds = awq.search_clip(
                weight,
                x.reshape(-1, weight.shape[1]),
                own,
                max_shrink=options.max_shrink,
                steps=options.clip_steps,
                independent_ends=options.clip_ends == "independent",
            )
            weight = awq.clip(weight, bounds)
        return rtn_quantize(weight, own), stats, weight

    return LinearQuantizer(quantize, statistics=clip_inputs)


def awq_step(scheme: WeightScheme, options: AWQOptions) -> WeightsStep:
    quantizer = clipping_quantizer(scheme, options)

    def step(work: LayerWork, smoothed: dict[str, dict], observer: StaticInputScale | None) -> Results:
        """Attention first, then the MLP: each block's scales are searched and folded, then its
        linears clipped and quantized, so the MLP's search sees the quantized attention."""
        if work.prefix.endswith(".layers.0"):  # said once, on the first layer
            log_unsmoothable(work.family, "AWQ")
        if work.min_tokens:  # experts with too few tokens get RTN: neither scaled nor clipped
            count_tokens(work, list(work.min_tokens))
        groups = list(awq_groups(work))
        ordered = [n for group in sequential_groups(work.layer, work.family) for n in group if n in work.targets]
        results: Results = {}
        for block in BLOCKS:
            searched = dict(smoothed)
            for group in groups:
                previous, linears, _ = group
                if linears[0].startswith(block):
                    searched.update(dict.fromkeys(linears, search_scale(work, scheme, options, group)))
                    work.updated[previous] = work.layer.get_submodule(previous)
            names = [n for n in ordered if n.startswith(block) and n not in results]
            results.update(quantize_linears(work, [names], quantizer, searched, observer))
        rest = [n for n in ordered if n not in results]
        results.update(quantize_linears(work, [rest], quantizer, smoothed, observer))
        return results

    return step
