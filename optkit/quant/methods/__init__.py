"""Quantization methods, found by name: each is one `Method` registered from its own module.

A method is either a *weights* stage (it turns each target linear into a `QuantizedWeight`: rtn,
gptq, awq, w8a8) or a *smoothing* stage (it rewrites the weights before one weights stage
quantizes them: smoothquant). A quantize run is a composition of stages, written as a list in
recipes (`stages: [smoothquant, gptq]`) and as its canonical name elsewhere (`smoothquant+gptq`,
the name recorded in optkit.json). Adding a method: one module that calls `register_method`, and
its import in `_BUILTIN` below (or, from outside optkit, a call to `register_method`).
"""

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from optkit.plugins import import_once
from optkit.weights.schemes import WeightScheme

# options (the whole QuantizeOptions), the stage that follows a smoothing stage (or None) -> procedure
ProcedureFactory = Callable[[Any, "Method | None"], Callable]
# full-precision weight, scheme, scale dtype -> QuantizedWeight (methods that need no calibration)
WeightQuantizer = Callable[..., Any]


@dataclass(frozen=True)
class Method:
    """One quantization method: what a recipe or `--method` names.

    options: the pydantic model of its settings (extra="forbid", every validation rule in it);
    its recipe section is `quantize.<section>` (default: the method's name). Built-in sections are
    declared on `QuantizeOptions`; a plug-in's section is validated by this model.
    procedure: calibrated methods, the layer procedure factory (calibrate.py runs it per layer).
    quantize_weight: data-free methods, one weight at a time (no calibration data is loaded).
    fixed_weights: the weight scheme the method always writes (W8A8: int8 per output channel),
    and with it int8 activations (`activations`); None for weight-only methods.
    formats / bits: what it can be written as (None: any). For smoothing stages, `then` lists the
    weights stages that may follow and `implies` those it already amounts to on its own.
    act_order(section) tells the format how columns are ordered (False, "group" or "weight");
    unused(section) is the error to raise when the section asks for something while the method is
    not part of the run (GPTQ's act_order with --method rtn). weight_type: the WeightScheme.type the
    method writes when its scheme is not fixed (nf4: any block size, optional double quantization)."""

    name: str
    summary: str
    stage: Literal["weights", "smoothing"] = "weights"
    options: type[BaseModel] | None = None
    section: str | None = None
    procedure: ProcedureFactory | None = None
    quantize_weight: WeightQuantizer | None = None
    fixed_weights: WeightScheme | None = None
    activations: Callable[[Any], str] | None = None  # options -> "dynamic" | "static" (W8A8)
    formats: tuple[str, ...] | None = None
    bits: tuple[int, ...] | None = None
    then: tuple[str, ...] = ()
    implies: tuple[str, ...] = ()
    act_order: Callable[[Any], bool | str] | None = None
    unused: Callable[[Any], str | None] | None = None
    weight_type: str = "int"  # the scheme type it writes (WeightScheme.type): "nf4" for the NF4 method

    def __post_init__(self):
        assert (self.procedure is None) != (self.quantize_weight is None) or self.stage == "smoothing", self.name
        if self.options is not None and self.section is None:
            object.__setattr__(self, "section", self.name)


_REGISTRY: dict[str, Method] = {}
_BUILTIN = ("rtn", "gptq", "awq", "w8a8", "fp8", "nf4", "smoothquant")  # registration order is --help's order
_load_builtin = import_once(__name__, _BUILTIN)


def register_method(method: Method) -> Method:
    _load_builtin()
    if method.name in _REGISTRY or "+" in method.name:
        raise ValueError(f"method name {method.name!r} is taken or contains '+'")
    _REGISTRY[method.name] = method
    return method


def unregister_method(name: str) -> None:
    _REGISTRY.pop(name, None)


@contextmanager
def registered_method(method: Method) -> Iterator[Method]:
    """`register_method` for the duration of a block (tests)."""
    register_method(method)
    try:
        yield method
    finally:
        unregister_method(method.name)


def registered_methods() -> dict[str, Method]:
    _load_builtin()
    return dict(_REGISTRY)


def method_names() -> list[str]:
    """Every name `--method` accepts: each method, then each smoothing composition."""
    methods = registered_methods()
    names = list(methods)
    for m in methods.values():
        names += [f"{m.name}+{t}" for t in m.then if t not in m.implies and t in methods]
    return names


@dataclass(frozen=True)
class Composition:
    """The stages of one run, smoothing first; `name` is the canonical method name."""

    stages: tuple[Method, ...]
    name: str = field(init=False)

    def __post_init__(self):
        smoothing = [s for s in self.stages if s.stage == "smoothing"]
        weights = [s for s in self.stages if s.stage == "weights"]
        implied = smoothing and weights and weights[0].name in smoothing[0].implies
        parts = [s.name for s in smoothing] + ([] if implied else [w.name for w in weights])
        object.__setattr__(self, "name", "+".join(parts))

    @property
    def smoothing(self) -> Method | None:
        return next((s for s in self.stages if s.stage == "smoothing"), None)

    @property
    def weights(self) -> Method | None:
        """The weights stage; None when a smoothing stage quantizes the weights itself."""
        stage = next((s for s in self.stages if s.stage == "weights"), None)
        smoothing = self.smoothing
        return None if stage is not None and smoothing and stage.name in smoothing.implies else stage

    @property
    def fixed_weights(self) -> WeightScheme | None:
        """The weights stage's fixed scheme (smoothquant+fp8: FP8), else the smoothing stage's."""
        return next((s.fixed_weights for s in reversed(self.stages) if s.fixed_weights is not None), None)

    def uses(self, name: str) -> bool:
        return any(s.name == name for s in self.stages)

    def procedure(self, options) -> Callable | None:
        """The layer procedure, or None when no stage needs calibration (see `quantize_weight`)."""
        if self.smoothing is not None:
            return self.smoothing.procedure(options, self.weights)
        return None if self.weights.procedure is None else self.weights.procedure(options, None)

    @property
    def quantize_weight(self) -> WeightQuantizer | None:
        return self.weights.quantize_weight if self.smoothing is None else None


def compose(stages: Iterable[str]) -> Composition:
    """The composition of a list of stage names, or a ValueError naming the stage to change.

    A smoothing stage rewrites the weights (it folds scales into them), so it comes before the
    one stage that quantizes the weights; two weights stages cannot both quantize the same weights."""
    stages = list(stages)
    methods = registered_methods()
    if not stages:
        raise ValueError("stages is empty: list at least one of " + ", ".join(methods))
    for index, stage in enumerate(stages, 1):
        if stage not in methods:
            raise ValueError(f"stage {index} {stage!r} is unknown: choose from {', '.join(methods)}")
    found = [methods[s] for s in stages]
    weights = [m.name for m in found if m.stage == "weights"]
    smoothing = [m for m in found if m.stage == "smoothing"]
    if len(weights) > 1:
        raise ValueError(f"stages {weights} both quantize the weights: keep one")
    if len(smoothing) > 1:
        raise ValueError(f"stages {[m.name for m in smoothing]} both smooth the weights: keep one")
    if smoothing:
        first = smoothing[0]
        if weights and stages.index(first.name) > stages.index(weights[0]):
            raise ValueError(
                f"stage {stages.index(first.name) + 1} {first.name!r} cannot follow the weight-only stage "
                f"{weights[0]!r}: smoothing rewrites the weights, so it must come first"
            )
        if weights and weights[0] not in first.then + first.implies:
            raise ValueError(
                f"stage {weights[0]!r} cannot follow {first.name!r}: "
                f"use {' or '.join(first.then)} for the 8-bit weights"
            )
    return Composition(tuple(sorted(found, key=lambda m: m.stage != "smoothing")))


def resolve(method: str | list[str]) -> Composition:
    """A `--method` name (`gptq`, `smoothquant+gptq`) or a list of stages, as a composition."""
    if isinstance(method, str):
        if method not in method_names():
            raise ValueError(f"unknown method {method!r}: choose one of {', '.join(method_names())}")
        method = method.split("+")
    return compose(method)
