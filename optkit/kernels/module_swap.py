"""A model's modules swapped in place for others that compute the same (kernels/cpu_bf16.py's and
kernels/cpu_fp32.py's linears)."""

from collections.abc import Callable

from torch import nn


def swap_modules(model: nn.Module, wanted: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module]) -> int:
    """Each module of `model`, at any depth, for which `wanted(module)` holds, replaced in its parent by
    `make(module)`; how many."""
    swaps = [
        (parent, name, child) for parent in model.modules() for name, child in parent.named_children() if wanted(child)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)
