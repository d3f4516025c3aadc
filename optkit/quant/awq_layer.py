"""AWQ on one decoder layer: search each smoothing group's scales on the block's output, fold
them, then clip and quantize (the math is in awq.py)."""

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from optkit.families import expand_smoothing_groups, log_unsmoothable
from optkit.families.llama import LLAMA
from optkit.quant import awq
from optkit.quant.calibrate import LayerProcedure, LayerWork, capture_inputs, sequential_groups
from optkit.quant.procedures import (
    SCALE_DTYPE,
    block_error,
    block_output,
    count_tokens,
    fold_scale,
    set_quantized,
    too_few_tokens,
)
from optkit.quant.rtn import rtn_quantize, weight_error
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme


class AWQOptions(BaseModel):
    """AWQ settings; the field names are the recipe keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grid: int = 20  # α ∈ {0, 1/grid, ..., (grid-1)/grid}
    duo_scaling: Literal["both", "on", "off"] = "both"  # search s = |x|^α, s = |x|^α / |w|^(1-α), or both
    clip: bool = True
    # AutoAWQ shrinks ±max|w| as one bound and skips q/k; on `small` both changes lower the KLD
    # (docs/results.md): asymmetric integers get each end of a group's range shrunk on its own, and q/k are clipped
    clip_ends: Literal["independent", "shared"] = "independent"
    clip_qk: bool = True
    max_shrink: float = 0.5  # clipping search: shrink each group's range by up to this fraction
    clip_steps: int = 20
    clip_tokens: int = 512  # tokens sampled for the clipping search (AutoAWQ's n_sample_token)
    search_samples: int = 32  # calibration sequences used by the scale and clip searches


# (operation whose output channels absorb 1/s, linears scaled by s, block whose output is compared):
# the family's smoothing groups (families/); these are Llama's
AWQ_GROUPS = LLAMA.smoothing_groups
BLOCKS = ("self_attn.", "mlp.")  # scale, then quantize, one block after the other
QK = ("self_attn.q_proj", "self_attn.k_proj")  # AutoAWQ does not clip them: their errors meet in q·kᵀ


def _awq_groups(work: LayerWork):
    """The smoothing groups that apply to this layer: present, all linears targeted, shapes fold."""
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


def awq_procedure(scheme: WeightScheme, options: AWQOptions) -> LayerProcedure:
    duo = {"both": (False, True), "on": (True,), "off": (False,)}[options.duo_scaling]

    def search_scale(work: LayerWork, previous: str, linears: tuple[str, ...], block: str) -> dict:
        # an expert's inputs weighted by its router (capture_inputs): only where the compared block
        # is the linear itself (an expert's down projection), as the weighting holds for a linear
        linear_block = block in linears
        x = capture_inputs(work, [linears[0]], options.search_samples, weighted=linear_block)[linears[0]]
        modules = [work.layer.get_submodule(n) for n in linears]
        originals = [m.weight.detach().clone() for m in modules]
        reference = block_output(work, block, x)
        x_mag = awq.activation_magnitude(x)
        w_mag = awq.weight_magnitude(originals, scheme)
        best = {"loss": float("inf")}
        for alpha, use_duo, s in awq.candidate_scales(x_mag, w_mag, options.grid, duo):
            for module, w in zip(modules, originals, strict=True):
                module.weight.copy_(awq.fake_quantize(w * s, scheme, SCALE_DTYPE) / s)
            loss = block_error(work, block, x, reference)
            if loss < best["loss"]:
                best = {"loss": loss, "alpha": alpha, "duo_scaling": use_duo, "s": s}
        for module, w in zip(modules, originals, strict=True):
            module.weight.copy_(w)
        fold_scale(work.layer, previous, linears, best.pop("s"), work.family.norm_weight_offset)
        return best

    def quantize_linears(work: LayerWork, names: list[str], searched: dict[str, dict]) -> dict:
        inputs = {}
        if options.clip:  # only the tokens the clipping search uses
            samples = min(options.search_samples, work.hidden.shape[0])
            rows = awq.clip_rows(samples * work.hidden.shape[1], options.clip_tokens)
            inputs = capture_inputs(work, names, samples, rows, weighted=True)
        results = {}
        for name in names:
            weight = work.layer.get_submodule(name).weight.detach().clone()
            stats = {"loss": float("nan"), **searched.get(name, {})}
            if name in work.min_tokens:
                stats["calibration_tokens"] = work.tokens_seen[name]
                if too_few_tokens(work, name, "AWQ"):
                    stats["fallback"] = "rtn"
            if options.clip and (options.clip_qk or name not in QK) and "fallback" not in stats:
                x = inputs[name].reshape(-1, weight.shape[1])
                bounds = awq.search_clip(
                    weight,
                    x,
                    scheme,
                    max_shrink=options.max_shrink,
                    steps=options.clip_steps,
                    independent_ends=options.clip_ends == "independent",
                    scale_dtype=SCALE_DTYPE,
                )
                weight = awq.clip(weight, bounds)
            qw = rtn_quantize(weight, scheme, SCALE_DTYPE)
            stats.update(weight_error(weight.cpu(), qw.dequantize()))
            set_quantized(work, name, qw)
            results[name] = (qw, stats)
            work.report(name, stats)
        return results

    def procedure(work: LayerWork) -> dict[str, tuple[QuantizedWeight, dict]]:
        """Attention first, then the MLP: each block's scales are searched and folded, then its
        linears clipped and quantized, so the MLP's search sees the quantized attention."""
        if work.prefix.endswith(".layers.0"):  # said once, on the first layer
            log_unsmoothable(work.family, "AWQ")
        if work.min_tokens:  # experts with too few tokens get RTN: neither scaled nor clipped
            count_tokens(work, list(work.min_tokens))
        groups = list(_awq_groups(work))
        ordered = [n for group in sequential_groups(work.layer, work.family) for n in group if n in work.targets]
        results: dict[str, tuple[QuantizedWeight, dict]] = {}
        for block in BLOCKS:
            searched: dict[str, dict] = {}
            for previous, linears, inspect in groups:
                if linears[0].startswith(block):
                    searched.update(dict.fromkeys(linears, search_scale(work, previous, linears, inspect)))
                    work.updated[previous] = work.layer.get_submodule(previous)
            names = [n for n in ordered if n.startswith(block) and n not in results]
            results.update(quantize_linears(work, names, searched))
        rest = [n for n in ordered if n not in results]
        results.update(quantize_linears(work, rest, {}))
        return results

    return procedure
