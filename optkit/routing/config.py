"""The `serve:` section of a recipe: several models, routing, shadow scoring and fallback.

Field names are the YAML keys; an unknown key is an error that names it. A recipe (or a file
holding only a `serve:` section) might read:

    serve:
      models:
        small-w2: {path: out/small-w2, kv_cache_fraction: 0.3}
        small: {path: small}
      route: tiered                      # model (default) | tiered | prefix
      tiers:
        order: [small-w2, small]         # cheap -> big
        default: small-w2
        rules:
          - {name: long, min_prompt_tokens: 200}           # escalate to the next tier
          - {regex: "(?i)\\bprove\\b", to: small}
      spill_over: {max_queue_wait_s: 2.0}
      shadow: {pairs: {small-w2: small}, rate: 0.05}
      fallback: {threshold: {kld: 0.5, top1: 80}, window: 20, recovery: manual}
      engine: {device: auto, max_num_seqs: 32}   # runtime/engine_args.py: every engine flag but --compile-dir

The flags of `optkit serve` override these keys (cli/serve_flags.py). Names are checked against the
models once everything is merged (`check_references`), before any model is loaded.
"""

import difflib
from typing import Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from optkit.errors import MAX_LINE_CHARS, OptkitError, shorten, shown
from optkit.runtime.engine_args import EngineArgs, check_file_engine_section
from optkit.untrusted_regex import check_untrusted


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Options):
    path: str  # model directory, artifact or reference name
    kv_cache_fraction: float | None = Field(None, gt=0, le=1)  # share of the KV memory budget
    kv_cache_blocks: int | None = Field(None, ge=1)
    task: str = "default"  # models of the same task may answer for each other (spill-over, prefix routing)

    @model_validator(mode="after")
    def _one_kv_budget(self) -> "ModelSpec":
        if self.kv_cache_fraction is not None and self.kv_cache_blocks is not None:
            raise ValueError("give kv_cache_fraction or kv_cache_blocks, not both")
        return self


class TierRule(_Options):
    """Escalate a request whose prompt matches: every condition given must hold."""

    name: str | None = None  # shown in the x-optkit-route header and on /metrics
    min_prompt_tokens: int | None = Field(None, ge=1)
    regex: str | None = None  # searched in the prompt's text (chat: the messages' contents)
    to: str | None = None  # the tier to escalate to; default: the next one after the request's tier

    @field_validator("regex")
    @classmethod
    def _compiles(cls, regex: str | None) -> str | None:
        if regex is not None:
            try:
                check_untrusted(regex, "regex")  # it runs on every prompt: no backtracking for ever
            except OptkitError as e:
                raise ValueError(str(e)) from None
        return regex

    @model_validator(mode="after")
    def _has_a_condition(self) -> "TierRule":
        if self.min_prompt_tokens is None and self.regex is None:
            raise ValueError("a tier rule needs min_prompt_tokens or regex")
        return self

    @property
    def label(self) -> str:
        return self.name or (f"min_prompt_tokens={self.min_prompt_tokens}" if self.regex is None else "regex")


class TiersOptions(_Options):
    order: list[str] | None = None  # cheap -> big; default: the models in the order given
    default: str | None = None  # the tier of a request that names none; default: the first
    rules: list[TierRule] = []
    header: str = "x-optkit-tier"  # a request header naming its tier explicitly (never escalated)

    @field_validator("header")
    @classmethod
    def _lower(cls, header: str) -> str:
        return header.lower()


class PrefixOptions(_Options):
    min_tokens: int = Field(64, ge=1)  # a shared prefix this long sticks to the engine that has it
    block_size: int = Field(16, ge=1)  # prefix hashing granularity: the engines' KV block size
    capacity: int = Field(100_000, ge=1)  # prefix blocks remembered (least recently used forgotten)


class SpillOverOptions(_Options):
    max_queue_wait_s: float | None = Field(None, gt=0)  # None: never spill
    window_s: float = Field(5.0, gt=0)  # how long an observed queue wait counts


class ShadowOptions(_Options):
    pairs: dict[str, str] = {}  # QUANT -> FULL
    rate: float = Field(0.05, ge=0, le=1)  # fraction of QUANT's requests replayed on FULL
    window: int = Field(100, ge=1)  # shadowed requests in the rolling window of /v1/optkit/shadow
    max_pending: int = Field(64, ge=1)  # replays queued beyond this are dropped (and counted)
    idle_s: float = Field(0.05, ge=0)  # replays run once no request has been in flight this long
    max_defer_s: float | None = Field(30.0, gt=0)  # then they run anyway (lowest OS priority); None: never
    chunk_tokens: int = Field(32, ge=1)  # tokens per forward step of a replay (pauses between them)
    seed: int | None = None  # of the sampling


class FallbackThreshold(_Options):
    """The gate's thresholds, on the rolling window of shadowed requests."""

    kld: float | None = Field(None, ge=0)  # max mean KL divergence, nats (optkit eval --max-kld)
    top1: float | None = Field(None, ge=0, le=100)  # min percent of same top tokens (--min-top1)
    ppl_increase: float | None = None  # max perplexity increase, percent (--max-ppl-increase)


FALLBACK_KEYS = tuple(FallbackThreshold.model_fields)


class FallbackOptions(_Options):
    threshold: FallbackThreshold | None = None
    window: int = Field(20, ge=1)  # shadowed requests the threshold is checked over
    recovery: Literal["manual", "auto"] = "manual"  # auto: switch back once a full window passes


ROUTES = ("model", "tiered", "prefix")


class BackendSpec(_Options):
    """An OpenAI-compatible upstream (`--backend NAME=URL`, upstream/engine.py): command line only."""

    url: str
    tokenizer: str | None = None  # default: the model directory the upstream names as its root
    key_env: str | None = None  # the environment variable holding the upstream's own API key
    max_concurrency: int = Field(16, ge=1)  # requests in flight to it
    timeout_s: float = Field(120.0, gt=0)  # for its first token, and between two chunks


class ServeOptions(_Options):
    models: dict[str, ModelSpec] = {}
    backends: dict[str, BackendSpec] = {}  # upstream servers, from the command line alone
    route: Literal["model", "tiered", "prefix"] = "model"
    tiers: TiersOptions = Field(default_factory=TiersOptions)
    prefix: PrefixOptions = Field(default_factory=PrefixOptions)
    spill_over: SpillOverOptions = Field(default_factory=SpillOverOptions)
    shadow: ShadowOptions = Field(default_factory=ShadowOptions)
    fallback: FallbackOptions = Field(default_factory=FallbackOptions)
    engine: EngineArgs = Field(default_factory=EngineArgs)  # what every served model's engine runs with

    @field_validator("backends", mode="before")
    @classmethod
    def _command_line_only(cls, backends, info):
        """Where optkit sends prompts (and an upstream key) is the command line's to say, never a file's."""
        if backends and not (info.context or {}).get("command_line"):
            raise ValueError("an upstream comes only from the command line (optkit serve --backend NAME=URL)")
        return backends

    @field_validator("engine", mode="before")
    @classmethod
    def _no_compile_dir(cls, engine):
        check_file_engine_section(engine)  # the compile cache is this machine's: never a file's to name
        return engine


def serve_options(data: dict, *, command_line: bool = False) -> ServeOptions:
    """Validated options; a user error naming the first bad key. `backends` only `command_line`."""
    try:
        options = ServeOptions.model_validate(data, context={"command_line": command_line})
        check_references(options)
    except ValidationError as e:
        raise OptkitError(_describe(e.errors()[0])) from None
    except OptkitError as e:  # the engine's or check_references' line, which may quote the file's values
        raise OptkitError(shorten(str(e), MAX_LINE_CHARS // 2)) from None
    return options


def _describe(error: dict) -> str:
    """The error's one line; the keys and values it quotes from the file are shortened."""
    where = shown(".".join(str(p) for p in error["loc"]))
    if error["type"] == "extra_forbidden":
        valid = _fields_at(error["loc"][:-1])
        close = difflib.get_close_matches(str(error["loc"][-1])[:100], valid, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys here: {', '.join(valid)}"
        return f"serve key {where} is unknown: {hint}"
    if error["type"] == "missing":
        return f"serve key {where} is required"
    message = shorten(error["msg"].removeprefix("Value error, "), MAX_LINE_CHARS // 2)
    if error["type"] == "value_error":
        return f"serve key {where}: {message}"
    return f"serve key {where}: {message} (got {shown(error.get('input'))})"


def _fields_at(path: tuple) -> list[str]:
    """Valid keys of the options model at `path` (a pydantic error location without its last key)."""
    model: type[BaseModel] = ServeOptions
    keys = list(path)
    while keys:
        field_info = model.model_fields.get(str(keys.pop(0)))
        annotation = getattr(field_info, "annotation", None)
        if get_origin(annotation) in (dict, list) and keys:
            keys.pop(0)  # a model's name, a rule's index
        inner = _options_model(annotation)
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _options_model(annotation) -> type[BaseModel] | None:
    """The options model inside `annotation` (X, X | None, dict[str, X], list[X])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in get_args(annotation) if (m := _options_model(arg)) is not None), None)


def check_references(options: ServeOptions) -> None:
    """Every model a setting names is served; the budgets add up. Before anything is loaded."""
    names = list(options.models) + list(options.backends)
    if not names:
        raise OptkitError("no model to serve: give MODEL, --model NAME=PATH, or a recipe whose serve: lists models")

    def known(name: str, where: str) -> None:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"served: {', '.join(names)}"
            raise OptkitError(f"{where} names model {name!r}, which is not served: {hint}")

    both = set(options.models) & set(options.backends)
    if both:
        raise OptkitError(f"{', '.join(sorted(both))}: a name is a --model or a --backend, not both")
    for name in names:
        if not name or any(c in name for c in "=, "):
            raise OptkitError(f"model name {name!r}: use a name without '=', ',' or spaces")
    tiers = options.tiers
    order = tiers.order if tiers.order is not None else names
    for i, tier in enumerate(order):
        known(tier, f"serve.tiers.order[{i}]")
    if len(set(order)) != len(order):
        raise OptkitError(f"serve.tiers.order {order} lists a tier twice: list each once")
    if tiers.default is not None:
        known(tiers.default, "serve.tiers.default")
        if tiers.default not in order:
            raise OptkitError(f"serve.tiers.default {tiers.default!r} is not in serve.tiers.order {order}: add it")
    for i, rule in enumerate(tiers.rules):
        if rule.to is not None:
            known(rule.to, f"tier rule {i + 1} ({rule.label})")
            if rule.to not in order:
                raise OptkitError(f"tier rule {i + 1} ({rule.label}) escalates to {rule.to!r}, not in {order}: add it")
    for quant, full in options.shadow.pairs.items():
        known(quant, f"--shadow {quant}={full}")
        known(full, f"--shadow {quant}={full}")
        if quant == full:
            raise OptkitError(f"--shadow {quant}={full}: shadow a model with another one (QUANT=FULL)")
        if quant in options.backends and full in options.backends:
            raise OptkitError(f"--shadow {quant}={full}: both are upstreams; a replay needs one model in this process")
    if options.fallback.threshold is not None:
        if not options.shadow.pairs:
            raise OptkitError("--fallback-threshold needs a shadow pair to measure: add --shadow QUANT=FULL")
        if all(getattr(options.fallback.threshold, key) is None for key in FALLBACK_KEYS):
            raise OptkitError(f"serve.fallback.threshold is empty: set one of {', '.join(FALLBACK_KEYS)}")
    fractions = {n: s.kv_cache_fraction for n, s in options.models.items() if s.kv_cache_fraction is not None}
    if sum(fractions.values()) > 1 + 1e-9:
        shown = ", ".join(f"{n}={f:g}" for n, f in fractions.items())
        raise OptkitError(f"--kv-cache-fraction {shown} adds up to more than 1: lower them")
