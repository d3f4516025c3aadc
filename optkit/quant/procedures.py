"""What each calibrated method does to one decoder layer (the layer loop is in calibrate.py).

A procedure gets a `LayerWork`, quantizes the target linears of that layer, leaves the layer
holding the dequantized weights (so the next layer is calibrated on quantized outputs) and
returns local name -> (QuantizedWeight, stats).
"""

import torch

from optkit.quant.calibrate import LayerProcedure, LayerWork, capture_hessians, sequential_groups
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
