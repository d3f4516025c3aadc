"""GPTQ on one decoder layer: true-sequential groups, each group's Hessians captured from the
already-quantized groups before it, then each linear quantized by gptq_quantize (math.py)."""

import torch

from optkit.quant.calibrate import LayerWork
from optkit.quant.layer_step import LinearQuantizer, WeightsStep, sequential_step, too_few_tokens
from optkit.quant.methods.gptq.math import accumulate_hessian, empty_hessian, gptq_quantize, output_error
from optkit.quant.methods.gptq.options import GPTQOptions
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.quant.moe import token_weight
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme


def capture_hessians(work: LayerWork, names: list[str]) -> dict[str, torch.Tensor]:
    """H = 2/N Σ x xᵀ of the inputs of each named linear; an expert's in --moe-calibration all
    H = 2/N Σ c_t x xᵀ, each token weighted by the router (quant/moe.py: expert_token_weights).

    Modules fed the very same input tensor (q/k/v; gate/up) share one Hessian: it is the same
    matrix, so it is accumulated once and the dict holds the same tensor under each name."""
    hessians: dict[str, tuple[torch.Tensor, int]] = {}
    owner_of: dict[str, str] = {}

    def on_input(name: str, x: torch.Tensor, owner: str) -> None:
        owner_of[name] = owner
        if owner == name:
            if name not in hessians:
                hessians[name] = empty_hessian(x.shape[-1], work.device)
            if x.numel():
                hessians[name] = accumulate_hessian(*hessians[name], x, token_weight(work.layer, name))

    work.run_until_seen(names, on_input)
    result = {}
    for name in names:  # an expert the router never chose saw no input: a zero Hessian, 0 tokens
        width = work.layer.get_submodule(name).in_features
        hessian, tokens = hessians.get(owner_of.get(name), empty_hessian(width, work.device))
        work.tokens_seen[name] = tokens
        result[name] = hessian
    return result


def gptq_step(scheme: WeightScheme, options: GPTQOptions) -> WeightsStep:
    """True-sequential GPTQ; an expert's linear with too few calibration tokens gets RTN."""

    def quantize(
        work: LayerWork, name: str, weight: torch.Tensor, hessian: torch.Tensor
    ) -> tuple[QuantizedWeight, dict, torch.Tensor]:
        own = work.scheme_for(name, scheme)
        rtn_qw = rtn_quantize(weight, own)
        rtn_w = rtn_qw.dequantize().to(weight.device)
        if too_few_tokens(work, name, "GPTQ"):
            qw, stats = rtn_qw, {"loss": output_error(weight, rtn_w, hessian), "fallback": "rtn"}
        else:
            result = gptq_quantize(weight, hessian, own, options, name=f"{work.prefix}.{name}")
            qw = result.weight
            stats = {"loss": result.loss, "rtn_loss": output_error(weight, rtn_w, hessian), "damp": result.damp}
        if name in work.tokens_seen and name in work.min_tokens:
            stats["calibration_tokens"] = work.tokens_seen[name]
        return qw, stats, weight

    return sequential_step(LinearQuantizer(quantize, statistics=capture_hessians))
