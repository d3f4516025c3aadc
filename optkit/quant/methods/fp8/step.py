"""FP8's step on a calibrated layer: each weight cast on its own (per_weight_quantizer), run through
the per-linear loop all the same for its static activation scales and the fp32 layer its scales are
taken from."""

from typing import Any

from optkit.quant.layer_step import WeightsStep, per_weight_quantizer, sequential_step
from optkit.quant.methods.fp8.math import fp8_quantize
from optkit.weights.schemes import WeightScheme


def fp8_step(options: Any, scheme: WeightScheme) -> WeightsStep:
    return sequential_step(per_weight_quantizer(fp8_quantize, scheme))
