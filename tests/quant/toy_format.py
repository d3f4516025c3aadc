"""A whole checkpoint format written outside optkit (tests/quant/test_plugin_format.py and
test_plugins.py register it): int8 codes, fp32 scales and zero points, one tensor each."""

import torch

from optkit.quant.formats import CheckpointFormat
from optkit.quant.formats.common import dequantize_layers
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme


class ToyFormat(CheckpointFormat):
    """int8 codes, fp32 scales and zero points, one tensor each; config block `quant_method: toy`.
    Every member it leaves out is CheckpointFormat's default."""

    NAME = "toy"
    MARKER = "toy_q"
    SUFFIXES = ("toy_q", "toy_scale", "toy_zero")

    def check(self, scheme, act_order, layers, activations=None) -> None:
        if activations is not None or act_order:
            raise ValueError("the toy format stores weight-only, in-order groups")

    def quantization_config(self, scheme, act_order, ignore, activations=None) -> dict:
        return {"quant_method": self.NAME, **scheme.model_dump(), "ignore": ignore}

    def compress(self, prefix, qw, activations=None) -> dict[str, torch.Tensor]:
        return {f"{prefix}.toy_q": qw.q, f"{prefix}.toy_scale": qw.scale.float(), f"{prefix}.toy_zero": qw.zero_point}

    def scheme_from_config(self, quant_config: dict) -> WeightScheme:
        return WeightScheme(**{k: quant_config[k] for k in ("bits", "group_size", "symmetric")})

    def decompress(self, prefix, tensors, scheme) -> QuantizedWeight:
        return QuantizedWeight(
            tensors[f"{prefix}.toy_q"], tensors[f"{prefix}.toy_scale"], tensors[f"{prefix}.toy_zero"], scheme
        )

    def dequantized_state_dict(self, tensors, quant_config, dtype=torch.float32):
        scheme = self.scheme_from_config(quant_config)
        read = lambda prefix: self.decompress(prefix, tensors, scheme)  # noqa: E731
        return dequantize_layers(tensors, self.MARKER, self.SUFFIXES, read, dtype)
