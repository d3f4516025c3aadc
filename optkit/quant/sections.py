"""The method sections of `QuantizeOptions` (`quantize.gptq`, `quantize.fp8`, a plug-in's): each is
validated by its registered method's own options model, and the run's stages checked against the
rest of the options (quant/quantize.py)."""

from pydantic import BaseModel, ValidationError

from optkit.quant import methods
from optkit.weights.schemes import WeightScheme


class SectionError(ValueError):
    """A method section's first validation error, where it is (`loc`, inside QuantizeOptions), and
    the model that rejected it: recipe.py names the key as for any other section."""

    def __init__(self, section: str, error: dict, model: type[BaseModel]):
        self.loc = (section, *error["loc"])
        self.type = error["type"]
        self.input = error.get("input")
        self.msg = error["msg"].removeprefix("Value error, ")
        self.model = model
        super().__init__(f"{'.'.join(map(str, self.loc))}: {self.msg}")


def split_sections(data: dict) -> tuple[dict, dict[str, BaseModel]]:
    """(the data without method sections, section -> its validated options)."""
    known = methods.sections()
    rest, found = {}, {}
    for key, value in data.items():
        if key not in known:
            rest[key] = value
            continue
        model = known[key].options
        try:
            found[key] = value if isinstance(value, model) else model.model_validate(value or {})
        except ValidationError as e:
            raise SectionError(key, e.errors()[0], model) from None
    return rest, found


def fixed_words(scheme: WeightScheme) -> str:
    """How a fixed scheme reads in an error: "int8 per output channel", "fp8 e4m3 per output channel"."""
    kind = {"int": f"int{scheme.bits}", "float": "fp8 e4m3", "nf4": "nf4"}[scheme.type]
    return f"{kind} per output channel" if scheme.group_size == -1 else f"{kind} in blocks of {scheme.group_size}"


def check_scheme(options) -> None:
    """The weight scheme is the one the stages write: their fixed scheme, type and bits."""
    composition = options.composition
    fixed = composition.fixed_weights
    if fixed is not None and options.weights != fixed:
        raise ValueError(
            f"{options.method} quantizes weights to {fixed_words(fixed)} (bits {fixed.bits}, "
            f"group_size {fixed.group_size}, {'symmetric' if fixed.symmetric else 'asymmetric'}"
            f"{'' if fixed.type == 'int' else ', type ' + fixed.type}): leave the weight scheme at that"
        )
    weight_type = composition.weights.weight_type
    if fixed is None and options.weights.type != weight_type:
        registered = methods.registered_methods().values()
        writes = {m.name: (m.weight_type, getattr(m.fixed_weights, "type", None)) for m in registered}
        writers = [name for name, types in writes.items() if options.weights.type in types]
        raise ValueError(
            f"method {options.method} writes weights.type {weight_type}, not {options.weights.type}"
            f"{' (written by method ' + ' or '.join(writers) + ')' if writers else ''}: "
            f"set weights.type {weight_type} or change the method"
        )
    for stage in composition.stages:
        if stage.bits is not None and options.weights.bits not in stage.bits:
            raise ValueError(
                f"{stage.name} quantizes to {', '.join(map(str, stage.bits))} bits, not {options.weights.bits}"
            )


def check_sections(options) -> None:
    """No section asks for what the run does not do (`unused`), and the activations are set where
    the run reads them (smoothquant+fp8: quantize.fp8, not quantize.smoothquant)."""
    composition = options.composition
    for method in methods.registered_methods().values():
        if method.unused is not None and not composition.uses(method.name):
            problem = method.unused(options.section(method), composition)
            if problem:
                raise ValueError(problem)
    owner = composition.activation_stage
    for stage in composition.stages:
        if stage.activations is None or owner is None or stage is owner:
            continue
        value, read = stage.activations(options.section(stage)), owner.activations(options.section(owner))
        if value != read:
            raise ValueError(
                f"quantize.{stage.section}.activations {value} contradicts quantize.{owner.section}.activations "
                f"{read}: {composition.name} reads the latter (set it there)"
            )
