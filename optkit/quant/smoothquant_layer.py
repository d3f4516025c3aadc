"""SmoothQuant W8A8 on one decoder layer: smooth the norm-fed groups (α fixed or searched on the
block's output), then quantize every linear to int8 per output channel (RTN or GPTQ) or to FP8 E4M3
per output channel (`weights="fp8"`, activations FP8 too), with a calibrated per-tensor input scale
when activations are static (the math is in smoothquant.py and fp8.py)."""

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from optkit.kernels import fp8 as fp8_kernels
from optkit.kernels.w8a8 import INT8_MAX
from optkit.quant import fp8
from optkit.quant import smoothquant as sq
from optkit.quant.calibrate import LayerProcedure, LayerWork, capture_hessians, capture_inputs, sequential_groups
from optkit.quant.families import log_unsmoothable
from optkit.quant.families.llama import LLAMA
from optkit.quant.gptq import GPTQOptions, gptq_quantize
from optkit.quant.procedures import SCALE_DTYPE, block_error, block_output, fold_scale, set_quantized
from optkit.quant.rtn import rtn_quantize, weight_error
from optkit.weights.quantized import QuantizedWeight


class SmoothQuantOptions(BaseModel):
    """SmoothQuant settings; the field names are the recipe keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    smooth: bool = True  # False: plain W8A8, the baseline SmoothQuant improves on
    # "auto" tries no smoothing and α = 0, 1/grid, ..., 1 per smoothing group (α = 0 still smooths:
    # s = 1/max|W_j| flattens the weights' columns); "no smoothing" keeps plain W8A8 where it is best
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
# the family's norm-fed smoothing groups (quant/families/); these are Llama's
SMOOTHING_GROUPS = LLAMA.norm_groups


def _input_absmax(work: LayerWork, names: list[str]) -> dict[str, torch.Tensor]:
    """max |x_j| per input channel of each named linear over all calibration samples: [in]."""
    absmax: dict[str, torch.Tensor] = {}

    def on_input(name: str, x: torch.Tensor, owner: str) -> None:
        channel_max = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        absmax[name] = torch.maximum(absmax[name], channel_max) if name in absmax else channel_max

    work.run_until_seen(names, on_input)
    return absmax


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

    def search_alpha(work: LayerWork, linears: tuple[str, ...], block: str, act_absmax: torch.Tensor) -> float | None:
        """The α whose smoothing + W8A8 (emulated, unfolded) gives the block output closest to float;
        None when plain W8A8 (no smoothing, s = 1) is closer than every α."""
        x = capture_inputs(work, [linears[0]], options.search_samples)[linears[0]]
        modules = [work.layer.get_submodule(n) for n in linears]
        originals = [m.weight.detach().clone() for m in modules]
        reference = block_output(work, block, x)
        best_alpha, best_loss = None, float("inf")
        candidates = [None] + [step / options.alpha_grid for step in range(options.alpha_grid + 1)]
        for alpha in candidates:
            if alpha is None:
                s = torch.ones_like(act_absmax, dtype=torch.float32)
            else:
                s = sq.smoothing_scales(act_absmax, originals, alpha)
            for module, w in zip(modules, originals, strict=True):
                module.weight.copy_(fake_weight(w * s) / s)
            handles = [
                m.register_forward_pre_hook(lambda _, a, s=s: (fake_activations(a[0] / s) * s,)) for m in modules
            ]
            loss = block_error(work, block, x, reference)
            for handle in handles:
                handle.remove()
            if loss < best_loss:
                best_alpha, best_loss = alpha, loss
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
            act_absmax = _input_absmax(work, [linears[0]])[linears[0]]
            alpha = search_alpha(work, linears, block, act_absmax) if options.alpha == "auto" else options.alpha
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
