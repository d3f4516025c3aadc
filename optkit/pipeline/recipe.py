"""Recipes: one YAML file that says how to make a release. Validated by typed models whose field
names are the YAML keys; an unknown key is an error that names it and the nearest valid one."""

import difflib
from pathlib import Path
from typing import get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from optkit.errors import MAX_LINE_CHARS, OptkitError, shorten, shown
from optkit.gate.options import GateOptions
from optkit.pipeline.vllm_deploy import DeployOptions
from optkit.quant import methods
from optkit.quant.formats import get_format
from optkit.quant.methods.composition import resolve
from optkit.quant.quantize import QuantizeOptions
from optkit.quant.sections import SectionError
from optkit.routing.config import ServeOptions
from optkit.speculative.options import SpeculatorSection
from optkit.yaml_files import load_yaml, read_yaml_mapping


class CompileOptions(BaseModel):
    """The `compile:` section: warm the released artifact at these decode batch sizes (capturing
    CUDA graphs on CUDA) into this machine's compile cache, as `optkit compile` does, and record
    what was warmed in optkit.json (a release never carries a compile cache: docs/releases.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8, 32, 64], min_length=1)
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str | None = None  # default: bfloat16 on CUDA, float32 on CPU
    torch_compile: bool = False  # also torch.compile each decode bucket (CUDA only)

    @model_validator(mode="after")
    def _positive(self):
        if any(size < 1 for size in self.batch_sizes):
            raise ValueError(f"batch sizes must be at least 1, got {self.batch_sizes}")
        return self


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str  # base model: directory or reference-model name
    stages: list[str] | None = None  # composable alternative to quantize.method, e.g. [smoothquant, gptq]
    quantize: QuantizeOptions = Field(default_factory=QuantizeOptions)
    gate: GateOptions = Field(default_factory=GateOptions)
    output: str  # the release directory
    compile: CompileOptions | None = None  # absent: no compile stage
    serve: ServeOptions = Field(default_factory=ServeOptions)  # how `optkit serve --recipe` serves it
    deploy: DeployOptions | None = None  # absent: no vllm.yaml in the release (pipeline/vllm_deploy.py)
    speculator: SpeculatorSection | None = None  # absent: no EAGLE head (pipeline/speculator_stage.py)

    @model_validator(mode="before")
    @classmethod
    def _stages_set_the_method(cls, data):
        """`stages: [smoothquant, gptq]`, or the same list as `quantize.method`, sets the method."""
        if not isinstance(data, dict):
            return data
        quantize = data.get("quantize")
        if data.get("stages") is None and isinstance(quantize, dict) and isinstance(quantize.get("method"), list):
            data = {
                **data,
                "stages": quantize["method"],
                "quantize": {k: v for k, v in quantize.items() if k != "method"},
            }
        if data.get("stages") is not None:
            stages = data["stages"]
            if not isinstance(stages, list) or not all(isinstance(stage, str) for stage in stages):
                raise ValueError(
                    f"stages must be a list of stage names such as [smoothquant, gptq], not {shown(stages)}"
                )
            if not isinstance(data.get("quantize") or {}, dict):
                return data  # the model names the section that is not a mapping
            quantize = dict(data.get("quantize") or {})
            method = resolve(stages).name  # a user error naming the stage (quant/methods/composition.py)
            if quantize.get("method") not in (None, method):
                raise ValueError(f"quantize.method {shown(quantize['method'])} contradicts stages {shown(stages)}")
            data = {**data, "quantize": {**quantize, "method": method}}
        return data

    @model_validator(mode="after")
    def _stages_an_outside_runtime_can_take(self):
        """A format run by an outside runtime (GGUF: llama.cpp) has nothing for `optkit compile` to
        warm, and the gate's repair raises a GGUF file's linears only along a K mix's types."""
        outside = get_format(self.quantize.format).runtime
        if self.compile is not None and outside is not None:
            raise ValueError(
                f"compile warms optkit's runtime, and a {self.quantize.format} release runs in {outside}: "
                "drop the compile section"
            )
        if self.deploy is not None and outside is not None:
            raise ValueError(
                f"deploy.engine vllm serves artifact directories, not a {self.quantize.format} file: drop deploy"
            )
        if self.gate.min_acceptance_length is not None and self.speculator is None:
            raise ValueError("gate.min_acceptance_length measures the release's EAGLE head: add a speculator section")
        if self.speculator is not None and outside is not None:
            raise ValueError(f"speculator heads run in optkit's runtime, not {outside}: drop the speculator section")
        if getattr(self.gate, "repair", None) is not None and outside is not None:
            _check_repairable_file(self.quantize)
        return self


def _check_repairable_file(quantize: QuantizeOptions) -> None:
    """gate.repair raises a GGUF K mix's linears along ggml's types (pipeline/repair_artifact.py);
    other one-file artifacts, and legacy GGUF types, it cannot."""
    from optkit.pipeline.repair_artifact import check_repairable

    gguf = quantize.gguf.model_dump() if quantize.gguf is not None else None
    try:
        check_repairable(quantize.format, gguf)
    except OptkitError as e:
        raise ValueError(f"gate.repair: {e}, or drop gate.repair") from None


def _fields_at(model: type[BaseModel], path: tuple) -> list[str]:
    """Valid keys of the nested model at `path` (a pydantic error location without its last key);
    `quantize`'s method sections are those of the registered methods (quant/methods/)."""
    for key in path:
        if model is QuantizeOptions and str(key) in methods.sections():
            model = methods.sections()[str(key)].options
            continue
        field = model.model_fields.get(str(key))
        annotation = getattr(field, "annotation", None)
        models = [a for a in (annotation, *get_args(annotation)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not models:  # a plain value, or no such key
            return []
        model = models[0]  # the section's model, also when the section is optional (Model | None)
    return list(model.model_fields) + (list(methods.sections()) if model is QuantizeOptions else [])


def _describe(error: dict) -> str:
    """The error's one line; the keys and values it quotes from the recipe are shortened."""
    section = (error.get("ctx") or {}).get("error")
    if isinstance(section, SectionError):  # a method section's own error, where it is in the recipe
        loc = (*error["loc"], *section.loc)
        error = {"loc": loc, "type": section.type, "msg": section.msg, "input": section.input}
    where = shown(".".join(str(p) for p in error["loc"]))
    message = shorten(error["msg"].removeprefix("Value error, "), MAX_LINE_CHARS // 2)
    if error["type"] == "extra_forbidden":
        valid = _fields_at(Recipe, error["loc"][:-1])
        close = difflib.get_close_matches(str(error["loc"][-1])[:100], valid, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys here: {', '.join(valid)}"
        return f"recipe key {where} is unknown: {hint}"
    if error["type"] == "missing":
        return f"recipe key {where} is required"
    if error["type"] == "value_error":
        return f"recipe key {where}: {message}" if error["loc"] else f"recipe: {message}"
    return f"recipe key {where}: {message} (got {shown(error.get('input'))})"


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`key.path=value` strings (values parsed as YAML) applied onto the recipe's data."""
    for override in overrides:
        if "=" not in override:
            raise OptkitError(f"--set {override!r} is not key.path=value")
        path, value = override.split("=", 1)
        node = data
        keys = path.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise OptkitError(f"--set {path}: {key!r} is not a section of the recipe")
        try:
            node[keys[-1]] = load_yaml(value)
        except (yaml.YAMLError, ValueError) as e:
            raise OptkitError(f"--set {path}: {shorten(value)} is not a YAML value ({shorten(str(e))})") from None
    return data


def load_recipe(path: str | Path, overrides: list[str] = ()) -> tuple[Recipe, dict]:
    """The validated recipe and its raw data (after overrides), as recorded in the manifest."""
    data = read_yaml_mapping(
        path, "recipe", missing_hint=" (see recipes/)", keys_hint=" (model, quantize, gate, output)"
    )
    data = apply_overrides(data, list(overrides))
    return parse_recipe(data, path), data


def parse_recipe(data: dict, source: str | Path) -> Recipe:
    """Validate a recipe's data; the first problem is a one-line error naming the key."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise OptkitError(f"{source}: {_describe(e.errors()[0])}") from e
    except OptkitError as e:  # from a section's own checks, which may quote the recipe's values
        raise OptkitError(f"{source}: {shorten(str(e), MAX_LINE_CHARS // 2)}") from e
