"""SmoothQuant W8A8 on one decoder layer: smooth the norm-fed groups (α fixed or searched on the
block's output), then quantize every linear to int8 per output channel (RTN or GPTQ) or to FP8 E4M3
per output channel (`weights="fp8"`, activations FP8 too), with a calibrated per-tensor input scale
when activations are static (the math is in smoothquant.py and fp8.py)."""

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from optkit.families import log_unsmoothable
from optkit.families.llama import LLAMA
from optkit.kernels import fp8 as fp8_kernels
from optkit.kernels.w8a8 import INT8_MAX
from optkit.quant import fp8
from optkit.quant import smoothquant as sq
from optkit.quant.calibrate import LayerProcedure, LayerWork, capture_hessians, capture_inputs, sequential_groups
from optkit.quant.gptq import GPTQOptions, gptq_quantize
from optkit.quant.procedures import SCALE_DTYPE, block_output, fold_scale, sample_errors, set_quantized
from optkit.quant.rtn import rtn_quantize, weight_error
from optkit.weights.quantized import QuantizedWeight


class SmoothQuantOptions(BaseModel):
    """SmoothQuant settings; the field names are the recipe keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    smooth: bool = True  # False: plain W8A8, the baseline SmoothQuant improves on
    # "auto" tries no smoothing and α = 0, 1/grid, ..., 1 per smoothing group (α = 0 still smooths:
    # s = 1/max|W_j| flattens the weights' columns) on half the search samples, and keeps the winner
    # only if it also beats no smoothing on the other half (search_folds, smoothquant.gain_holds)
    alpha: float | Literal["auto"] = "auto"
    alpha_grid: int = 20
    activations: Literal["dynamic", "static"] = "dynamic"  # per-token at run time, or one calibrated scale
    search_samples: int = 32

    @field_validator("alpha", mode="before")
    @classmethod
    def _alpha_in_unit_interval(cls, value):
        if value == "auto":
            return value
        try:
            alpha = float(value)
        except (TypeError, ValueError):
            alpha = -1.0
        if isinstance(value, bool) or not 0 <= alpha <= 1:
            raise ValueError("give a number in [0, 1] or auto")
        return value


# (norm whose output channels absorb 1/s, linears it feeds, block whose output "auto" compares):
# the family's norm-fed smoothing groups (families/); these are Llama's
SMOOTHING_GROUPS = LLAMA.norm_groups


def _input_absmax(work: LayerWork, names: list[str]) -> dict[str, torch.Tensor]:
    """max |x_j| per input channel of each named linear over all calibration samples: [in]."""
    absmax: dict[str, torch.Tensor] = {}

    def on_input(name: str, x: torch.Tensor, owner: str) -> None:
        channel_max = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        absmax[name] = torch.maximum(absmax[name], channel_max) if name in absmax else channel_max

    work.run_until_seen(names, on_input)
    return absmax


def _sample_absmax(work: LayerWork, name: str) -> torch.Tensor:
    """max |x_j| per calibration sample and input channel of the named linear: [N, in]."""
    rows: list[torch.Tensor] = []

    def on_input(_: str, x: torch.Tensor, owner: str) -> None:
        rows.append(x.reshape(x.shape[0], -1, x.shape[-1]).abs().amax(dim=1).float())

    work.run_until_seen([name], on_input)
    return torch.cat(rows)


def search_folds(num_search: int, num_samples: int) -> list[tuple[slice, torch.Tensor]]:
    """The α search's two halves of its `num_search` samples: (the samples a half scores, a mask
    over all `num_samples` calibration samples of those whose activation maxima set its scales,
    the samples outside it). The first half chooses α, the second checks it. Scored on the samples
    that set them, scales fit those samples' own channel maxima and look better than they are.
    One search sample: one fold, scored with its own scales, nothing to check on."""
    if num_search < 2:
        return [(slice(0, num_search), torch.ones(num_samples, dtype=torch.bool))]
    half = num_search // 2
    folds = []
    for scored in (slice(0, half), slice(half, num_search)):
        outside = torch.ones(num_samples, dtype=torch.bool)
        outside[scored] = False
        folds.append((scored, outside))
    return folds


def smoothquant_procedure(
    options: SmoothQuantOptions,
    weights: Literal["rtn", "gptq", "fp8"] = "rtn",
    gptq_options: GPTQOptions = GPTQOptions(),
) -> LayerProcedure:
    # what the α search emulates: the weights and activations the artifact will hold
    if weights == "fp8":
        fake_weight, fake_activations = fp8.fake_quantize_weight, fp8_kernels.fake_quantize_activations
    else:
        fake_weight, fake_activations = sq.fake_quantize_weight, sq.fake_quantize_activations
    act_max = fp8_kernels.FP8_MAX if weights == "fp8" else INT8_MAX

    def search_alpha(
        work: LayerWork, linears: tuple[str, ...], block: str, sample_absmax: torch.Tensor
    ) -> float | None:
        """The α whose smoothing + W8A8 (emulated, unfolded) gives the block output closest to float
        on the first half of the search samples; None when plain W8A8 (no smoothing, s = 1) is
        closer there, or when that α does not also beat it on the second half (smoothquant.gain_holds).

        The tiny Phi-3 without outliers, calibrated on 8 samples, shows why: the α chosen on all
        of them (and checked by nothing) served 1.027x plain W8A8's KLD on 400 held-out windows."""
        x = capture_inputs(work, [linears[0]], options.search_samples)[linears[0]]  # [S, L, in]
        modules = [work.layer.get_submodule(n) for n in linears]
        originals = [m.weight.detach().clone() for m in modules]
        reference = block_output(work, block, x)

        def errors(alpha: float | None, scored: slice, act_absmax: torch.Tensor) -> torch.Tensor:
            """Per-sample block errors of the scored samples under this α's smoothing: [n]."""
            if alpha is None:
                s = torch.ones_like(act_absmax)
            else:
                s = sq.smoothing_scales(act_absmax, originals, alpha)
            for module, w in zip(modules, originals, strict=True):
                module.weight.copy_(fake_weight(w * s) / s)
            handles = [
                m.register_forward_pre_hook(lambda _, a, s=s: (fake_activations(a[0] / s) * s,)) for m in modules
            ]
            try:
                return sample_errors(work, block, x[scored], reference[scored])
            finally:
                for handle in handles:
                    handle.remove()

        folds = [
            (scored, sample_absmax[outside].amax(dim=0).to(x.device))
            for scored, outside in search_folds(x.shape[0], sample_absmax.shape[0])
        ]
        choose, *check = folds
        candidates = [None] + [step / options.alpha_grid for step in range(options.alpha_grid + 1)]
        best_alpha, best_loss = None, float("inf")
        for alpha in candidates:
            loss = errors(alpha, *choose).mean().item()
            if loss < best_loss:
                best_alpha, best_loss = alpha, loss
        if (
            best_alpha is not None
            and check
            and not sq.gain_holds(errors(best_alpha, *check[0]), errors(None, *check[0]))
        ):
            best_alpha = None
        for module, w in zip(modules, originals, strict=True):
            module.weight.copy_(w)
        return best_alpha

    def smooth(work: LayerWork) -> dict[str, dict]:
        if work.prefix.endswith(".layers.0"):  # said once, on the first layer
            log_unsmoothable(work.family, "SmoothQuant")
        searched: dict[str, dict] = {}
        for previous, linears, block in work.family.norm_groups:
            if not all(n in work.targets for n in linears):
                continue
            sample_absmax = _sample_absmax(work, linears[0])  # [N, in]
            act_absmax = sample_absmax.amax(dim=0)
            alpha = search_alpha(work, linears, block, sample_absmax) if options.alpha == "auto" else options.alpha
            if alpha is None:  # plain W8A8 is closer to float here than any smoothing
                searched.update(dict.fromkeys(linears, {"smoothing": "none"}))
                continue
            originals = [work.layer.get_submodule(n).weight.detach() for n in linears]
            scales = sq.smoothing_scales(act_absmax, originals, alpha)
            fold_scale(work.layer, previous, linears, scales, work.family.norm_weight_offset)
            work.updated[previous] = work.layer.get_submodule(previous)
            searched.update(dict.fromkeys(linears, {"alpha": alpha}))
        return searched

    def procedure(work: LayerWork) -> dict[str, tuple[QuantizedWeight, dict]]:
        searched = smooth(work) if options.smooth else {}
        results = {}
        for group in sequential_groups(work.layer, work.family):
            group = [n for n in group if n in work.targets]
            if not group:
                continue
            hessians = capture_hessians(work, group) if weights == "gptq" else {}
            absmax = _input_absmax(work, group) if options.activations == "static" else {}
            for name in group:
                weight = work.layer.get_submodule(name).weight.detach()
                full_name = f"{work.prefix}.{name}"
                stats = {"loss": float("nan"), **searched.get(name, {})}
                if weights == "gptq":
                    result = gptq_quantize(
                        weight,
                        hessians.pop(name),
                        sq.W8_PER_CHANNEL,
                        gptq_options,
                        scale_dtype=SCALE_DTYPE,
                        name=full_name,
                    )
                    qw, stats["loss"] = result.weight, result.loss
                elif weights == "fp8":
                    qw = fp8.fp8_quantize(weight, fp8.FP8_PER_CHANNEL, SCALE_DTYPE)
                else:
                    qw = rtn_quantize(weight, sq.W8_PER_CHANNEL, SCALE_DTYPE)
                if name in absmax:
                    qw.input_scale = (absmax[name].max() / act_max).clamp(min=1e-12).reshape(1).cpu()
                stats.update(weight_error(weight.cpu(), qw.dequantize()))
                set_quantized(work, name, qw)
                results[name] = (qw, stats)
                work.report(name, stats)
        return results

    return procedure
