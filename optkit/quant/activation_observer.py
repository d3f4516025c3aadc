"""Activation quantization of W8A8 methods: per token at run time ("dynamic", nothing to calibrate)
or one calibrated per-tensor scale ("static"): max |x| over the calibration inputs of each linear
divided by the activation type's largest value (int8's 127, FP8 E4M3's 448). The observer attaches
that `input_scale` to whatever weights step quantizes the linear (quant/layer_step.py)."""

import torch

from optkit.kernels.fp8 import FP8_MAX
from optkit.kernels.w8a8 import INT8_MAX
from optkit.weights.schemes import WeightScheme


class StaticInputScale:
    """Per-tensor input scales from the calibration inputs' absolute maximum."""

    def __init__(self, act_max: float):
        self.act_max = act_max

    def observe(self, work, names: list[str]) -> dict[str, torch.Tensor]:
        """max |x_j| per input channel of each named linear over all calibration samples: [in]."""
        absmax: dict[str, torch.Tensor] = {}

        def on_input(name: str, x: torch.Tensor, owner: str) -> None:
            channel_max = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            absmax[name] = torch.maximum(absmax[name], channel_max) if name in absmax else channel_max

        work.run_until_seen(names, on_input)
        return absmax

    def input_scale(self, absmax: torch.Tensor) -> torch.Tensor:
        return (absmax.max() / self.act_max).clamp(min=1e-12).reshape(1).cpu()


def activation_observer(activations: str | None, scheme: WeightScheme) -> StaticInputScale | None:
    """The observer a run's activations need: None unless they are static."""
    if activations != "static":
        return None
    return StaticInputScale(FP8_MAX if scheme.type == "float" else INT8_MAX)
