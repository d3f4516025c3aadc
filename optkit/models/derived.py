"""A value derived from modules' weights, kept while they stand.

A fused CPU decode layer (models/fused_layer.py) hands its C++ call the layer's weights gathered
once, not at every step: gathering them through nn.Module's attribute lookups and the packed layers'
checks cost about as much Python time as the call's own work at batch 1 (docs/results.md). What it
keeps must still follow the model when someone changes it, as the module path does:
`Derived.stands()` checks that every watched module and tensor is the same object in the same place
(nothing replaced or assigned), on the same storage (no `.data =`, no `.to()`) and at the same version
(no in-place change; inference tensors have no version and cannot change outside inference mode);
`Derived.hooked()`, that no forward hook watches a module. Both run at every step, in C++ where
kernels/cpu_watch.py builds (right after a step has streamed its weights, each object is a cache
miss: there they are in flight together), else in C-level Python loops; the answers are the same.
"""

from operator import attrgetter, is_

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from optkit.kernels import cpu_watch

_version = attrgetter("_version")
_forward_hooks, _forward_pre_hooks = attrgetter("_forward_hooks"), attrgetter("_forward_pre_hooks")

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
        # the same checks in C++ where the library builds (kernels/cpu_watch.py), else the loops below
        self._watch = cpu_watch.watch(self.holders, self.names, self.held, self.tensors, self.versioned, self.modules)

    def __getstate__(self) -> dict:
        """For copy.deepcopy (a module's deep copy copies what it keeps) and pickle: the C++ watch is
        left out, so a copy checks in Python, where its copied tensors' data pointers are not the
        state's: it does not stand, and the copy gathers its own."""
        return {**self.__dict__, "_watch": None}

    def _state(self) -> tuple[list[int], list[int]]:
        return list(map(torch.Tensor.data_ptr, self.tensors)), list(map(_version, self.versioned))

    def stands(self) -> bool:
        """Whether every slot holds what it held, on the same storage, unchanged (this runs at every
        step: C++ or C-level loops)."""
        if self._watch is not None:
            return self._watch.stands()
        return all(map(is_, map(dict.get, self.holders, self.names), self.held)) and self._state() == self.state

    def hooked(self) -> bool:
        """Whether a forward hook or pre-hook watches any of `modules` (torch's global hooks included)."""
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return True
        if self._watch is not None:
            return self._watch.hooked()
        return any(map(_forward_hooks, self.modules)) or any(map(_forward_pre_hooks, self.modules))
