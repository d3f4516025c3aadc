"""SmoothQuant's smoothing stage on one decoder layer: each norm-fed group gets its scales (α fixed,
or searched on the block's output against the W8A8 the artifact will hold) folded into the norm
and the linears it feeds. The weights stage that follows quantizes them (math.py: the scales)."""

from collections.abc import Callable

import torch

from optkit.families import log_unsmoothable
from optkit.kernels import fp8 as fp8_kernels
from optkit.quant.calibrate import LayerWork, capture_inputs
from optkit.quant.layer_step import block_output, fold_scale, sample_errors
from optkit.quant.methods.fp8 import math as fp8
from optkit.quant.methods.smoothquant import math as sq
from optkit.quant.methods.smoothquant.options import SmoothQuantOptions
from optkit.weights.schemes import WeightScheme


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


class AlphaSearch:
    """The α whose smoothing + W8A8 (emulated, unfolded) gives the block output closest to float on
    the first half of the search samples; None when plain W8A8 (no smoothing, s = 1) is closer
    there, or when that α does not also beat it on the second half (smoothquant.gain_holds): an α
    chosen and checked on the same samples can lose to plain W8A8 on other text (docs/results.md)."""

    def __init__(self, options: SmoothQuantOptions, scheme: WeightScheme):
        self.options = options
        # what the search emulates: the weights and activations the artifact will hold
        if scheme.type == "float":
            self.fake_weight, self.fake_activations = fp8.fake_quantize_weight, fp8_kernels.fake_quantize_activations
        else:
            self.fake_weight, self.fake_activations = sq.fake_quantize_weight, sq.fake_quantize_activations

    def __call__(self, work: LayerWork, linears: tuple[str, ...], block: str, sample_absmax: torch.Tensor):
        x = capture_inputs(work, [linears[0]], self.options.search_samples)[linears[0]]  # [S, L, in]
        modules = [work.layer.get_submodule(n) for n in linears]
        originals = [m.weight.detach().clone() for m in modules]
        reference = block_output(work, block, x)

        def errors(alpha: float | None, scored: slice, act_absmax: torch.Tensor) -> torch.Tensor:
            """Per-sample block errors of the scored samples under this α's smoothing: [n]."""
            s = torch.ones_like(act_absmax) if alpha is None else sq.smoothing_scales(act_absmax, originals, alpha)
            for module, w in zip(modules, originals, strict=True):
                module.weight.copy_(self.fake_weight(w * s) / s)
            fake = self.fake_activations
            handles = [m.register_forward_pre_hook(lambda _, a, s=s: (fake(a[0] / s) * s,)) for m in modules]
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
        candidates = [None] + [step / self.options.alpha_grid for step in range(self.options.alpha_grid + 1)]
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


def smoothing_stage(options: SmoothQuantOptions, scheme: WeightScheme) -> Callable[[LayerWork], dict[str, dict]] | None:
    """Smooth one layer; returns each smoothed linear's stats (its α, or smoothing "none").
    None with `smooth: false` (plain W8A8)."""
    if not options.smooth:
        return None
    search = AlphaSearch(options, scheme)

    def smooth(work: LayerWork) -> dict[str, dict]:
        if work.prefix.endswith(".layers.0"):  # said once, on the first layer
            log_unsmoothable(work.family, "SmoothQuant")
        searched: dict[str, dict] = {}
        for previous, linears, block in work.family.norm_groups:
            if not all(n in work.targets for n in linears):
                continue
            sample_absmax = _sample_absmax(work, linears[0])  # [N, in]
            act_absmax = sample_absmax.amax(dim=0)
            alpha = search(work, linears, block, sample_absmax) if options.alpha == "auto" else options.alpha
            if alpha is None:  # plain W8A8 is closer to float here than any smoothing
                searched.update(dict.fromkeys(linears, {"smoothing": "none"}))
                continue
            originals = [work.layer.get_submodule(n).weight.detach() for n in linears]
            scales = sq.smoothing_scales(act_absmax, originals, alpha)
            fold_scale(work.layer, previous, linears, scales, work.family.norm_weight_offset)
            work.updated[previous] = work.layer.get_submodule(previous)
            searched.update(dict.fromkeys(linears, {"alpha": alpha}))
        return searched

    return smooth
