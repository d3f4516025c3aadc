"""Quantization methods, found by name: each is one folder, `quant/methods/NAME/`, whose `method.py`
registers one `Method` (its math in math.py, its per-layer step in step.py, its options in
options.py), or, from outside optkit, one `register_method` call.

A method is either a *weights* stage (it turns each target linear into a `QuantizedWeight`: rtn,
gptq, awq, w8a8, fp8, nf4) or a *smoothing* stage (it rewrites the weights before one weights stage
quantizes them: smoothquant). A quantize run is a composition of stages (composition.py), written
as a list in recipes (`stages: [smoothquant, gptq]`) and as its canonical name elsewhere
(`smoothquant+gptq`, the name recorded in optkit.json).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from optkit.plugins import import_once
from optkit.weights.schemes import WeightScheme

# full-precision weight, scheme, scale dtype -> QuantizedWeight
WeightQuantizer = Callable[..., Any]


@dataclass(frozen=True)
class Flag:
    """One `optkit quantize` option, setting `field` of its method's section. Methods may share a
    flag (`--act-quant`): it sets the field of each of them that the run uses."""

    name: str  # "--damp"; a bool takes "--act-order/--no-act-order"
    field: str
    help: str
    type: type = str  # what click parses the text as (bool: an on/off switch)
    parse: Callable[[Any], Any] | None = None  # then the value for the field (SmoothQuant's number or auto)

    @property
    def parameter(self) -> str:
        """The flag's Python name (click's): "--act-order/--no-act-order" -> "act_order"."""
        return self.name.split("/")[0].removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class Workload:
    """What a method's memory estimate reads (quant/plan.py fills it from config.json and the
    safetensors headers): the linears, each layer's true-sequential groups, the calibration size."""

    linears: dict[str, tuple[int, int]]  # full name -> (out_features, in_features)
    layers: list[tuple[str, list[list[str]]]]  # (prefix, groups of local names)
    hidden_size: int
    num_samples: int
    seq_len: int


@dataclass(frozen=True)
class Method:
    """One quantization method: what a recipe or `--method` names.

    options: the pydantic model of its settings (extra="forbid", every validation rule in it),
    read from the recipe section `quantize.<section>` (default: the method's name); `flags` set its
    fields from `optkit quantize`. A weights stage has `quantize_weight` (one weight at a time: with
    no `step`, the method is data-free and no calibration data is loaded) and/or `step(section,
    scheme)`, its calibrated layer step (quant/layer_step.py: WeightsStep); a smoothing stage has
    `smooth(section, scheme)`: a function that folds scales into one layer and returns each
    smoothed linear's stats (None: nothing to smooth with these options).
    memory(section, workload): the bytes its step holds beyond one decoder layer's (quant/plan.py).
    fixed_weights: the weight scheme the method always writes (W8A8: int8 per output channel),
    and with it quantized activations: `activations(section)` is "dynamic" or "static".
    formats / bits: what it can be written as (None: any). For smoothing stages, `then` lists the
    weights stages that may follow and `implies` those it already amounts to on its own (the first
    is the weights stage that runs then).
    act_order(section) tells the format how columns are ordered (False, "group" or "weight");
    unused(section, composition) is the error to raise when the section asks for something the
    run does not do (GPTQ's act_order with --method rtn). resolve(section, options) fills what
    the section left unset (GPTQ: the format's defaults). weight_type: the WeightScheme.type the
    method writes when its scheme is not fixed (nf4)."""

    name: str
    summary: str
    stage: Literal["weights", "smoothing"] = "weights"
    options: type[BaseModel] | None = None
    section: str | None = None
    flags: tuple[Flag, ...] = ()
    quantize_weight: WeightQuantizer | None = None
    step: Callable[[Any, WeightScheme], Callable] | None = None
    smooth: Callable[[Any, WeightScheme], Callable | None] | None = None
    memory: Callable[[Any, Workload], int] | None = None
    fixed_weights: WeightScheme | None = None
    activations: Callable[[Any], str] | None = None  # section -> "dynamic" | "static" (W8A8)
    formats: tuple[str, ...] | None = None
    bits: tuple[int, ...] | None = None
    then: tuple[str, ...] = ()
    implies: tuple[str, ...] = ()
    act_order: Callable[[Any], bool | str] | None = None
    unused: Callable[[Any, Any], str | None] | None = None
    resolve: Callable[[Any, Any], Any] | None = None
    weight_type: str = "int"  # the scheme type it writes (WeightScheme.type): "nf4" for the NF4 method

    def __post_init__(self):
        if self.stage == "smoothing":
            assert self.smooth is not None and self.implies, self.name
        else:
            assert self.step is not None or self.quantize_weight is not None, self.name
        if self.options is not None and self.section is None:
            object.__setattr__(self, "section", self.name)

    @property
    def calibrated(self) -> bool:
        return self.step is not None or self.stage == "smoothing"


_REGISTRY: dict[str, Method] = {}
_BUILTIN = ("rtn", "gptq", "awq", "w8a8", "fp8", "nf4", "smoothquant")  # registration order is --help's order
_load_builtin = import_once(__name__, tuple(f"{name}.method" for name in _BUILTIN))


def register_method(method: Method) -> Method:
    _load_builtin()
    if method.name in _REGISTRY or "+" in method.name:
        raise ValueError(f"method name {method.name!r} is taken or contains '+'")
    sections = {m.section for m in _REGISTRY.values() if m.section is not None}
    if method.section in sections:
        raise ValueError(f"method {method.name!r}: recipe section {method.section!r} is taken")
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


def sections() -> dict[str, Method]:
    """Recipe section name -> the method whose options it holds."""
    return {m.section: m for m in registered_methods().values() if m.section is not None}


def flags() -> dict[str, list[tuple[Method, Flag]]]:
    """Every `optkit quantize` flag a method declares: name -> the (method, flag) pairs it sets."""
    found: dict[str, list[tuple[Method, Flag]]] = {}
    for method in registered_methods().values():
        for flag in method.flags:
            found.setdefault(flag.name, []).append((method, flag))
    return found
