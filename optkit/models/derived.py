"""A value derived from modules' weights, kept while they stand.

A fused CPU decode layer (models/fused_layer.py) hands its C++ call the layer's weights gathered
once, not at every step: gathering them through nn.Module's attribute lookups and the packed layers'
checks cost about as much Python time as the call's own work at batch 1 (docs/results.md). What it
keeps must still follow the model when someone changes it, as the module path does:
`Derived.stands()` checks, in C-level loops, that every watched module and tensor is the same object in
the same place (nothing replaced or assigned), on the same storage (no `.data =`, no `.to()`) and at
the same version (no in-place change; inference tensors have no version and cannot change outside
inference mode).
"""

from operator import attrgetter, is_

import torch
from torch import nn

_version = attrgetter("_version")

Slot = tuple[dict, str, object]  # the dict that holds an attribute, its name, the object it held


def slot(parent: nn.Module, name: str) -> Slot:
    """Where `parent.name` lives (its parameters, buffers or submodules) and what it holds now. A name
    in none of them (a submodule not made yet, held as None) is watched in the submodules, where
    assigning one puts it."""
    for held in (parent._parameters, parent._buffers, parent._modules):
        if name in held:
            return held, name, held[name]
    return parent._modules, name, None


def tensors_of(module: nn.Module) -> list[Slot]:
    """The slots of a module's own parameters and buffers (not its submodules')."""
    return [slot(module, name) for name in (*module._parameters, *module._buffers)]


class Derived:
    """`value`, computed from what `slots` hold; `modules`: the modules among them (their hooks are the
    caller's to check, at every call: registering one changes no slot)."""

    def __init__(self, value, slots: list[Slot]):
        self.value = value
        self.holders = [holder for holder, _, _ in slots]
        self.names = [name for _, name, _ in slots]
        self.held = [obj for _, _, obj in slots]
        self.modules = [obj for obj in self.held if isinstance(obj, nn.Module)]
        self.tensors = [obj for obj in self.held if isinstance(obj, torch.Tensor)]
        self.versioned = [t for t in self.tensors if not t.is_inference()]
        self.state = self._state()

    def _state(self) -> tuple[list[int], list[int]]:
        return list(map(torch.Tensor.data_ptr, self.tensors)), list(map(_version, self.versioned))

    def stands(self) -> bool:
        """Whether every slot holds what it held, on the same storage, unchanged (C-level loops: this
        runs at every layer of every step)."""
        return all(map(is_, map(dict.get, self.holders, self.names), self.held)) and self._state() == self.state
