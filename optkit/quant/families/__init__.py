"""Model families, found by `model_type`: what quantization needs to know of a decoder layer
(the linears in true-sequential order, the smoothing groups) and which runtime module runs it.

Adding a family (a MoE, Gemma, Phi-3...): one module that calls `register_family`, imported in
`_BUILTIN` below. A model_type no family claims is calibrated with Llama's names (only the names
its layers have count; other linears go last, one at a time), and the runtime refuses it.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from optkit.quant.plugins import import_once

# (module whose output channels absorb 1/s, linears scaled by s, block whose output is compared)
SmoothingGroup = tuple[str, tuple[str, ...], str]


@dataclass(frozen=True)
class Family:
    """sequential_groups: local linear names of one decoder layer, grouped in the order calibration
    quantizes them (each group's inputs come from the already-quantized groups before it).
    smoothing_groups: which norm or linear precedes which linears (AWQ uses all of them; SmoothQuant
    the norm-fed ones, `norm_groups`). runtime: "module:class" of the runtime model (optkit/models/),
    named as text so quant/ never imports the runtime. unsmoothable: linears no norm or linear of the
    layer precedes in a way a scale folds into, with the reason (AWQ/SmoothQuant skip them and say so).
    embedding_scale: the factor the model multiplies its embeddings by, from the transformers config
    (calibration feeds the first layer what the model would)."""

    name: str
    model_types: tuple[str, ...]
    sequential_groups: tuple[tuple[str, ...], ...]
    smoothing_groups: tuple[SmoothingGroup, ...] = ()
    runtime: str | None = None
    unsmoothable: tuple[tuple[tuple[str, ...], str], ...] = ()
    embedding_scale: Callable[[object], float] | None = None
    # the norms scale by (offset + weight) (Gemma: 1): a smoothing scale s folds as w ← (offset + w)/s − offset
    norm_weight_offset: float = 0.0
    # (checkpoint prefix, runtime prefix) where they differ, and checkpoint prefixes the runtime leaves
    # out, with the reason (Gemma 3's vision tower): the runtime model's view of the checkpoint
    runtime_renames: tuple[tuple[str, str], ...] = ()
    outside_runtime: tuple[tuple[str, ...], str] | None = None

    @property
    def norm_groups(self) -> tuple[SmoothingGroup, ...]:
        """The smoothing groups fed by a norm (not by another linear of the layer)."""
        linears = {n for group in self.sequential_groups for n in group}
        return tuple(g for g in self.smoothing_groups if g[0] not in linears)


log = logging.getLogger(__name__)


def log_unsmoothable(family: Family, method: str) -> None:
    """One log line per group of linears that `method` (AWQ, SmoothQuant) cannot smooth."""
    for linears, reason in family.unsmoothable:
        log.warning("%s: %s leaves %s unsmoothed: %s", family.name, method, ", ".join(linears), reason)


_FALLBACK = "llama"
_REGISTRY: dict[str, Family] = {}
_BUILTIN = ("llama", "granite", "olmo2", "gemma")
_load_builtin = import_once(__name__, _BUILTIN)


def register_family(family: Family) -> Family:
    _load_builtin()
    taken = [t for t in family.model_types if t in _REGISTRY]
    if taken:
        raise ValueError(f"model_type {taken[0]!r} already belongs to family {_REGISTRY[taken[0]].name!r}")
    _REGISTRY.update(dict.fromkeys(family.model_types, family))
    return family


def unregister_family(family: Family) -> None:
    for model_type in family.model_types:
        if _REGISTRY.get(model_type) is family:
            del _REGISTRY[model_type]


def family_for(model_type: str | None) -> Family:
    _load_builtin()
    return _REGISTRY.get(model_type) or _REGISTRY[_FALLBACK]


def model_types(runtime: bool = False) -> tuple[str, ...]:
    """Every registered model_type (with `runtime`, those the optkit runtime runs)."""
    _load_builtin()
    return tuple(t for t, f in _REGISTRY.items() if f.runtime or not runtime)
