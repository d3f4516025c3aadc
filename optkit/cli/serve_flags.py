"""`optkit serve`'s flags onto the `serve:` section (routing/config.py): flags override key by key.

`--model NAME=PATH` adds NAME or replaces its path; `--kv-cache-fraction NAME=F`,
`--kv-cache-blocks NAME=N` (or N: every model) and `--task NAME=TASK` set that model's key; every
other flag replaces its key (`--tiers FILE` the whole tiers section, `--shadow` the pairs,
`--fallback-threshold` the threshold, `--device` the `engine:` section's device).
"""

import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path

from optkit.cli.serve_backends import backends_section
from optkit.errors import OptkitError
from optkit.pipeline.recipe import parse_recipe
from optkit.routing.config import FALLBACK_KEYS, ServeOptions, serve_options
from optkit.yaml_files import read_yaml_mapping


@dataclass
class ServeFlags:
    """`optkit serve`'s flags as given; None (or empty) where the flag was not given."""

    models: list[str] = field(default_factory=list)  # NAME=PATH
    kv_cache_fraction: list[str] = field(default_factory=list)  # NAME=F
    kv_cache_blocks: list[str] = field(default_factory=list)  # NAME=N, or N for every model
    task: list[str] = field(default_factory=list)  # NAME=TASK
    route: str | None = None
    tiers: str | None = None  # a YAML file of the tiers section
    max_queue_wait: float | None = None
    prefix_min_tokens: int | None = None
    shadow: list[str] = field(default_factory=list)  # QUANT=FULL
    shadow_rate: float | None = None
    fallback_threshold: str | None = None  # kld=X,top1=Y
    fallback_window: int | None = None
    fallback_recovery: str | None = None
    backends: list[str] = field(default_factory=list)  # NAME=URL (cli/serve_backends.py)
    backend_key: list[str] = field(default_factory=list)  # NAME=ENVVAR
    backend_tokenizer: list[str] = field(default_factory=list)  # NAME=DIR
    backend_concurrency: list[str] = field(default_factory=list)  # NAME=N
    backend_timeout: float | None = None
    engine: dict = field(default_factory=dict)  # the engine flags given (runtime/engine_args.py's keys)

    @classmethod
    def from_params(cls, params: dict, engine: dict) -> "ServeFlags":
        """The flags from `optkit serve`'s parameters by name (a repeatable flag not given is None there)."""
        values = {f.name: params[f.name] for f in fields(cls) if f.name != "engine"}
        for f in fields(cls):
            if f.default_factory is list:
                values[f.name] = list(values[f.name] or [])
        tiers = values["tiers"]
        return cls(**{**values, "tiers": None if tiers is None else str(tiers)}, engine=engine)


def parse_pairs(values: list[str], flag: str, what: str = "VALUE") -> dict[str, str]:
    """["a=x", "b=y"] -> {"a": "x", "b": "y"}; a user error naming the flag otherwise."""
    pairs: dict[str, str] = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name.strip() or not rest.strip():
            raise OptkitError(f"{flag} {value!r}: expected NAME={what}")
        pairs[name.strip()] = rest.strip()
    return pairs


def parse_threshold(text: str) -> dict[str, float]:
    """ "kld=0.5,top1=80" -> {"kld": 0.5, "top1": 80.0}; unknown keys name the valid ones."""
    threshold = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if key not in FALLBACK_KEYS:
            close = difflib.get_close_matches(key, FALLBACK_KEYS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"use {', '.join(FALLBACK_KEYS)}"
            raise OptkitError(f"--fallback-threshold: unknown key {key!r}: {hint}")
        try:
            threshold[key] = float(value)
        except ValueError:
            raise OptkitError(f"--fallback-threshold {part!r}: expected {key}=NUMBER") from None
    if not threshold:
        keys = ", ".join(FALLBACK_KEYS)
        raise OptkitError(f"--fallback-threshold {text!r}: give at least one of {keys}, e.g. kld=0.5")
    return threshold


def read_serve_section(path: str) -> dict:
    """The `serve:` section of a recipe file (a whole recipe is validated as one; a file may also
    hold only a `serve:` section)."""
    data = read_yaml_mapping(path, "--recipe", missing_hint=" with a serve: section")
    if not isinstance(data.get("serve"), dict):
        raise OptkitError(f"recipe {path} has no serve: section: add one (see docs/serving.md)")
    if set(data) != {"serve"}:
        parse_recipe(data, path)  # a release recipe: all of it must be valid
    return data["serve"]


def apply_flags(data: dict, flags: ServeFlags) -> dict:
    """The serve section's data with the flags applied (see the module's docstring)."""
    data = {key: dict(value) if isinstance(value, dict) else value for key, value in data.items()}
    models = {name: dict(spec) if isinstance(spec, dict) else spec for name, spec in (data.get("models") or {}).items()}
    for name, path in parse_pairs(flags.models, "--model", "PATH").items():
        models[name] = {**(models.get(name) or {}), "path": path}

    def set_per_model(values: list[str], flag: str, key: str, convert) -> None:
        for name, value in parse_pairs(values, flag).items():
            if name not in models:
                served = ", ".join(models) or "none"
                raise OptkitError(f"{flag} {name}={value}: no model {name!r} is served (serving: {served})")
            try:
                models[name] = {**models[name], key: convert(value)}
            except ValueError:
                raise OptkitError(f"{flag} {name}={value}: {value!r} is not a number") from None

    blocks = []  # N alone: every model; a later NAME=N overrides it
    for value in flags.kv_cache_blocks:
        blocks += [value] if "=" in value else [f"{name}={value}" for name in models]
    set_per_model(blocks, "--kv-cache-blocks", "kv_cache_blocks", int)
    set_per_model(flags.kv_cache_fraction, "--kv-cache-fraction", "kv_cache_fraction", float)
    set_per_model(flags.task, "--task", "task", str)
    if models:
        data["models"] = models
    if flags.route is not None:
        data["route"] = flags.route
    if flags.tiers is not None:
        data["tiers"] = read_yaml_mapping(flags.tiers, "--tiers")
    if flags.max_queue_wait is not None:
        data["spill_over"] = {**(data.get("spill_over") or {}), "max_queue_wait_s": flags.max_queue_wait}
    if flags.prefix_min_tokens is not None:
        data["prefix"] = {**(data.get("prefix") or {}), "min_tokens": flags.prefix_min_tokens}
    shadow = dict(data.get("shadow") or {})
    if flags.shadow:
        shadow["pairs"] = parse_pairs(flags.shadow, "--shadow", "FULL")
    if flags.shadow_rate is not None:
        shadow["rate"] = flags.shadow_rate
    if shadow:
        data["shadow"] = shadow
    fallback = dict(data.get("fallback") or {})
    if flags.fallback_threshold is not None:
        fallback["threshold"] = parse_threshold(flags.fallback_threshold)
    if flags.fallback_window is not None:
        fallback["window"] = flags.fallback_window
    if flags.fallback_recovery is not None:
        fallback["recovery"] = flags.fallback_recovery
    if fallback:
        data["fallback"] = fallback
    if "backends" in data:
        raise OptkitError("serve.backends: an upstream comes only from the command line (--backend NAME=URL)")
    if flags.backends:
        data["backends"] = backends_section(flags)
    if flags.engine:
        engine = data.get("engine")
        data["engine"] = {**(engine if isinstance(engine, dict) else {}), **flags.engine}
    return data


def resolve_options(
    model: str | None, served_model_name: str | None, recipe: str | None, flags: ServeFlags
) -> ServeOptions:
    """ServeOptions from a recipe's serve: section, the MODEL argument and the flags."""
    if model is not None:
        name = served_model_name or Path(model).resolve().name
        if not name:
            raise OptkitError(f"cannot name the model from {model!r}: pass --served-model-name")
        flags.models = [f"{name}={model}", *flags.models]
    elif served_model_name is not None:
        raise OptkitError("--served-model-name names the MODEL argument: with --model, write NAME=PATH")
    data = read_serve_section(recipe) if recipe is not None else {}
    return serve_options(apply_flags(data, flags), command_line=True)
