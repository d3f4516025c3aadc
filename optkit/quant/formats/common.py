"""What every checkpoint reader shares."""

from collections.abc import Callable

import torch

from optkit.weights.quantized import QuantizedWeight


def dequantize_layers(
    tensors: dict[str, torch.Tensor],
    marker: str,
    suffixes: tuple[str, ...],
    read_layer: Callable[[str], QuantizedWeight],
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """A plain state dict: each quantized layer (found by its `marker` tensor, e.g. "qweight")
    replaced by its dequantized `weight`; every other tensor as stored."""
    prefixes = [k.removesuffix(f".{marker}") for k in tensors if k.endswith(f".{marker}")]
    state = {k: v for k, v in tensors.items() if not k.endswith(suffixes)}
    for prefix in prefixes:
        state[f"{prefix}.weight"] = read_layer(prefix).dequantize(dtype)
    return state
