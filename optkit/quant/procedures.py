"""What each calibrated method does to one decoder layer (the layer loop is in calibrate.py).

A procedure gets a `LayerWork`, quantizes the target linears of that layer, leaves the layer
holding the dequantized weights (so the next layer is calibrated on quantized outputs) and
returns local name -> (QuantizedWeight, stats).
"""

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

from optkit.quant import awq
from optkit.quant.calibrate import LayerProcedure, LayerWork, capture_hessians, capture_inputs, sequential_groups
from optkit.quant.gptq import GPTQOptions, gptq_quantize, output_error
from optkit.quant.rtn import QuantizedWeight, rtn_quantize, weight_error
from optkit.quant.schemes import WeightScheme

SCALE_DTYPE = torch.bfloat16  # layers are calibrated in fp32; scales are stored as in bf16 checkpoints


def set_quantized(work: LayerWork, name: str, qw: QuantizedWeight) -> None:
    work.layer.get_submodule(name).weight.copy_(qw.dequantize().to(work.device))


def gptq_procedure(scheme: WeightScheme, options: GPTQOptions) -> LayerProcedure:
    """True-sequential GPTQ: each group's Hessians come from the already-quantized groups before it."""

    def procedure(work: LayerWork) -> dict[str, tuple[QuantizedWeight, dict]]:
        results = {}
        for group in sequential_groups(work.layer):
            group = [n for n in group if n in work.targets]
            if not group:
                continue
            hessians = capture_hessians(work, group)
            for name in group:
                weight = work.layer.get_submodule(name).weight.detach()
                hessian = hessians.pop(name)
                full_name = f"{work.prefix}.{name}"
                result = gptq_quantize(weight, hessian, scheme, options, scale_dtype=SCALE_DTYPE, name=full_name)
                rtn_w = rtn_quantize(weight, scheme, SCALE_DTYPE).dequantize().to(weight.device)
                stats = {
                    "loss": result.loss,
                    "rtn_loss": output_error(weight, rtn_w, hessian),
                    "damp": result.damp,
                    **weight_error(weight.cpu(), result.weight.dequantize()),
                }
                set_quantized(work, name, result.weight)
                results[name] = (result.weight, stats)
                work.report(name, stats)
        return results

    return procedure


class AWQOptions(BaseModel):
    """AWQ settings; the field names are the recipe keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    grid: int = 20  # α ∈ {0, 1/grid, ..., (grid-1)/grid}
    duo_scaling: Literal["both", "on", "off"] = "both"  # search s = |x|^α, s = |x|^α / |w|^(1-α), or both
    clip: bool = True
    max_shrink: float = 0.5  # clipping search: shrink each group's range by up to this fraction
    clip_steps: int = 20
    search_samples: int = 32  # calibration sequences used by the scale and clip searches


# (operation whose output channels absorb 1/s, linears scaled by s, block whose output is compared)
AWQ_GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)
BLOCKS = ("self_attn.", "mlp.")  # scale, then quantize, one block after the other
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")  # their errors meet in q·kᵀ: clipping each alone misleads


def fold_scale(layer: torch.nn.Module, previous: str, linears: tuple[str, ...], s: torch.Tensor) -> None:
    """W_i ← W_i diag(s) for each linear, and the previous operation's output channels ← / s."""
    prev = layer.get_submodule(previous)
    if isinstance(prev, torch.nn.Linear):
        prev.weight.div_(s.view(-1, 1))
        if prev.bias is not None:
            prev.bias.div_(s)
    else:  # RMSNorm / LayerNorm: y = norm(x) * weight
        prev.weight.div_(s)
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s)
    for name in linears:
        layer.get_submodule(name).weight.mul_(s.view(1, -1))


def _block_output(work: LayerWork, block: str, x: torch.Tensor) -> torch.Tensor:
    module = work.layer.get_submodule(block)
    if block.endswith("self_attn"):
        return module(hidden_states=x, position_embeddings=work.rope, attention_mask=None)[0]
    return module(x)


def _awq_groups(work: LayerWork):
    """The smoothing groups that apply to this layer: present, all linears targeted, shapes fold."""
    for previous, linears, block in AWQ_GROUPS:
        try:
            prev = work.layer.get_submodule(previous)
            modules = [work.layer.get_submodule(n) for n in linears]
        except AttributeError:
            continue
        width = prev.out_features if isinstance(prev, torch.nn.Linear) else prev.weight.shape[0]
        if all(n in work.targets for n in linears) and all(m.in_features == width for m in modules):
            yield previous, linears, block


def awq_procedure(scheme: WeightScheme, options: AWQOptions) -> LayerProcedure:
    duo = {"both": (False, True), "on": (True,), "off": (False,)}[options.duo_scaling]

    def search_scale(work: LayerWork, previous: str, linears: tuple[str, ...], block: str) -> dict:
        x = capture_inputs(work, [linears[0]], options.search_samples)[linears[0]]
        modules = [work.layer.get_submodule(n) for n in linears]
        originals = [m.weight.detach().clone() for m in modules]
        reference = _block_output(work, block, x)
        x_mag = awq.activation_magnitude(x)
        w_mag = awq.weight_magnitude(originals, scheme)
        best = {"loss": float("inf")}
        for alpha, use_duo, s in awq.candidate_scales(x_mag, w_mag, options.grid, duo):
            for module, w in zip(modules, originals, strict=True):
                module.weight.copy_(awq.fake_quantize(w * s, scheme, SCALE_DTYPE) / s)
            loss = (_block_output(work, block, x) - reference).pow(2).mean().item()
            if loss < best["loss"]:
                best = {"loss": loss, "alpha": alpha, "duo_scaling": use_duo, "s": s}
        for module, w in zip(modules, originals, strict=True):
            module.weight.copy_(w)
        fold_scale(work.layer, previous, linears, best.pop("s"))
        return best

    def quantize_linears(work: LayerWork, names: list[str], searched: dict[str, dict]) -> dict:
        inputs = capture_inputs(work, names, options.search_samples) if options.clip else {}
        results = {}
        for name in names:
            weight = work.layer.get_submodule(name).weight.detach().clone()
            stats = {"loss": float("nan"), **searched.get(name, {})}
            if options.clip and name not in NO_CLIP:
                x = inputs[name].reshape(-1, weight.shape[1])
                bound = awq.search_clip(
                    weight,
                    x,
                    scheme,
                    max_shrink=options.max_shrink,
                    steps=options.clip_steps,
                    scale_dtype=SCALE_DTYPE,
                )
                weight = awq.clip(weight, bound)
            qw = rtn_quantize(weight, scheme, SCALE_DTYPE)
            stats.update(weight_error(weight.cpu(), qw.dequantize()))
            set_quantized(work, name, qw)
            results[name] = (qw, stats)
            work.report(name, stats)
        return results

    def procedure(work: LayerWork) -> dict[str, tuple[QuantizedWeight, dict]]:
        """Attention first, then the MLP: each block's scales are searched and folded, then its
        linears clipped and quantized, so the MLP's search sees the quantized attention."""
        groups = list(_awq_groups(work))
        ordered = [n for group in sequential_groups(work.layer) for n in group if n in work.targets]
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
