"""A quantize run as stages: at most one smoothing stage, then the one weights stage, and the one
place a method name is normalised (`resolve`: `smoothquant+gptq`, or a recipe's list of stages)."""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from optkit.quant.methods import Method, WeightQuantizer, method_names, registered_methods
from optkit.weights.schemes import WeightScheme


@dataclass(frozen=True)
class Composition:
    """The stages of one run, smoothing first, without a weights stage the smoothing implies
    (`[smoothquant, rtn]` is `smoothquant`); `name` is the canonical method name."""

    stages: tuple[Method, ...]
    name: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "name", "+".join(s.name for s in self.stages))

    @property
    def smoothing(self) -> Method | None:
        return next((s for s in self.stages if s.stage == "smoothing"), None)

    @property
    def weights(self) -> Method:
        """The weights stage that runs: the one named, or the first that the smoothing implies."""
        stage = next((s for s in self.stages if s.stage == "weights"), None)
        return stage if stage is not None else registered_methods()[self.smoothing.implies[0]]

    @property
    def fixed_weights(self) -> WeightScheme | None:
        """The weights stage's fixed scheme (smoothquant+fp8: FP8), else the smoothing stage's."""
        return next((s.fixed_weights for s in reversed(self.stages) if s.fixed_weights is not None), None)

    @property
    def activation_stage(self) -> Method | None:
        """The stage whose section says how activations are quantized: the weights stage's if it
        has that setting (smoothquant+fp8: quantize.fp8), else the smoothing stage's."""
        return next((s for s in (self.weights, self.smoothing) if s is not None and s.activations), None)

    def uses(self, name: str) -> bool:
        return any(s.name == name for s in self.stages)

    @property
    def calibrated(self) -> bool:
        return any(s.calibrated for s in self.stages)

    @property
    def quantize_weight(self) -> WeightQuantizer | None:
        """The data-free quantizer, when no stage needs calibration."""
        return None if self.calibrated else self.weights.quantize_weight

    def procedure(self, options) -> Callable | None:
        """The layer procedure of calibrated runs (`options`: the whole QuantizeOptions)."""
        from optkit.quant.activation_observer import activation_observer
        from optkit.quant.layer_step import layer_procedure, per_weight_quantizer, sequential_step

        if not self.calibrated:
            return None
        scheme, weights, smoothing = options.weights, self.weights, self.smoothing
        smooth = smoothing.smooth(options.section(smoothing), scheme) if smoothing is not None else None
        if weights.step is not None:
            step = weights.step(options.section(weights), scheme)
        else:
            step = sequential_step(per_weight_quantizer(weights.quantize_weight, scheme))
        return layer_procedure(smooth, step, activation_observer(options.activations, scheme))


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
        found = [m for m in found if m.name not in first.implies]
    return Composition(tuple(sorted(found, key=lambda m: m.stage != "smoothing")))


def resolve(method: str | list[str] | tuple[str, ...]) -> Composition:
    """A `--method` name (`gptq`, `smoothquant+gptq`) or a list of stages, as a composition."""
    if isinstance(method, str):
        if method not in method_names():
            raise ValueError(f"unknown method {method!r}: choose one of {', '.join(method_names())}")
        method = method.split("+")
    return compose(method)
