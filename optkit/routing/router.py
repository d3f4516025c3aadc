"""The router: which engine answers each request (docs/serving.md).

Policies (`route`):
- `model`: the request's `model` names the engine (OpenAI's semantics); no `model`: the first one;
  an unknown name is an `UnknownModel` (errors.py; the server answers 404).
- `tiered`: the request starts at the tier its `model` names (or the default tier), its prompt may
  escalate it (tiers.py), a tier named in the `x-optkit-tier` header is taken as is.
- `prefix`: a `model` stands for its task's models (or name a task); a prompt whose first
  `prefix.min_tokens` tokens or more were last sent to one of them goes there again (its prefix is
  in that engine's cache), others to the least loaded.
Then, for `tiered` and `prefix`, spill-over: when the chosen engine's queue wait exceeds
`spill_over.max_queue_wait_s`, the request goes to the least waiting model of the same task, if
that one waits less than the bound. Last, fallback: a quantized model in fallback hands its
requests to its full-precision pair. A request answered by a shadowed model (or its pair, in
fallback) is sampled for a replay, queued once it has finished.
"""

import dataclasses
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field

from optkit.routing.config import ServeOptions
from optkit.routing.errors import UnknownModel, UnknownTier
from optkit.routing.fallback import FallbackMonitor
from optkit.routing.load import LoadTracker, PrefixTable
from optkit.routing.shadow import ShadowJob, ShadowService
from optkit.routing.tiers import TierPolicy


@dataclass
class Prompt:
    """A request's prompt, tokenized for whichever engine's tokenizer asks (once per tokenizer)."""

    encode: Callable[[object], list[int]]  # tokenizer -> token ids; may raise the caller's errors
    text: Callable[[object], str]  # tokenizer -> the text tier rules search
    _ids: dict[int, list[int]] = field(default_factory=dict)

    def ids_for(self, tokenizer) -> list[int]:
        if id(tokenizer) not in self._ids:
            self._ids[id(tokenizer)] = self.encode(tokenizer)
        return self._ids[id(tokenizer)]

    def prepare(self, tokenizers: list) -> None:
        """Tokenize for each of `tokenizers` now (the server does it off its event loop)."""
        for tokenizer in tokenizers:
            self.ids_for(tokenizer)


@dataclass
class Route:
    name: str  # the model that answers
    engine: object
    prompt_ids: list[int]
    reason: str  # model, default, tier, header, rule:LABEL, prefix, balance, spill, fallback
    shadow: str | None = None  # the shadowed (quantized) model this request is replayed for


class Router:
    def __init__(
        self,
        engines: dict[str, object],
        options: ServeOptions | None = None,
        *,
        shadow: ShadowService | None = None,
        fallbacks: dict[str, FallbackMonitor] | None = None,
        load: LoadTracker | None = None,
    ):
        self.engines = engines
        self.names = list(engines)
        self.options = options = options or ServeOptions()
        self.load = load or LoadTracker(self.names, options.spill_over.window_s)
        self.tiers = TierPolicy(options.tiers, self.names)
        self.prefixes = PrefixTable(options.prefix.block_size, options.prefix.capacity)
        self.tasks = {n: options.models[n].task if n in options.models else "default" for n in self.names}
        self.shadow = shadow
        self.fallbacks = fallbacks or {}
        self.routed: Counter[tuple[str, str]] = Counter()  # (model, reason) -> requests

    @classmethod
    def single(cls, engine) -> "Router":
        return cls({engine.model_name: engine})

    @property
    def default(self) -> str:
        return self.tiers.default if self.options.route == "tiered" else self.names[0]

    def route(self, model: str | None, headers: Mapping[str, str], prompt: Prompt) -> Route:
        policy = self.options.route
        if policy == "tiered":
            name, reason = self._tiered(self._requested(model), headers, prompt)
        elif policy == "prefix":
            name, reason = self._prefix(model, prompt)
        else:
            requested = self._requested(model)
            name, reason = (requested, "model") if requested else (self.default, "default")
        monitor = self.fallbacks.get(name)
        shadowed = name if self.shadow is not None and name in self.shadow.pairs else None
        if monitor is not None and monitor.active:
            name, reason = monitor.full, "fallback"
        engine = self.engines[name]
        prompt_ids = prompt.ids_for(engine.tokenizer)
        self.routed[(name, reason)] += 1
        sampled = shadowed if shadowed is not None and self.shadow.sample() else None
        return Route(name, engine, prompt_ids, reason, sampled)

    def tokenizers_for(self, model: str | None) -> list:
        """The tokenizers `route` may encode a request for `model` with: the named (or default)
        model's and its fallback pair's under `model` routing, every model's otherwise."""
        if self.options.route == "model":
            name = model if model in self.engines else self.default
            names = [name] + ([self.fallbacks[name].full] if name in self.fallbacks else [])
        else:
            names = self.names
        return list({id(t): t for t in (self.engines[n].tokenizer for n in names)}.values())

    def _requested(self, model: str | None) -> str | None:
        if model is not None:
            self.check_model(model)
        return model

    def check_model(self, model: str) -> None:
        """`UnknownModel` naming the served models, unless `model` is one."""
        if model not in self.engines:
            raise UnknownModel(model, self.names)

    def _tiered(self, requested: str | None, headers: Mapping[str, str], prompt: Prompt) -> tuple[str, str]:
        tiers = self.tiers
        pinned = headers.get(tiers.header)
        if pinned is not None:
            if pinned not in tiers.order:
                raise UnknownTier(tiers.header, pinned, tiers.order)
            return pinned, "header"
        if requested is not None and requested not in tiers.order:
            return requested, "model"
        start = requested or tiers.default
        tokenizer = self.engines[start].tokenizer
        tier, rule = tiers.escalate(start, len(prompt.ids_for(tokenizer)), prompt.text(tokenizer))
        reason = f"rule:{rule}" if rule else ("tier" if requested else "default")
        return self._spill(tier, reason, [t for t in tiers.order if self.tasks[t] == self.tasks[tier]])

    def _prefix(self, model: str | None, prompt: Prompt) -> tuple[str, str]:
        if model is not None and model not in self.engines and model in self.tasks.values():
            task = model  # a task's name stands for its models
        else:
            task = self.tasks[self._requested(model) or self.default]
        group = [n for n in self.names if self.tasks[n] == task]
        ids = prompt.ids_for(self.engines[group[0]].tokenizer)
        hashes = self.prefixes.block_hashes(ids)
        owner, matched = self.prefixes.lookup(hashes, group)
        if owner is not None and matched >= self.options.prefix.min_tokens:
            name, reason = owner, "prefix"
        else:
            name, reason = min(group, key=lambda n: (self.load.running[n], self.load.queue_wait(n))), "balance"
        name, reason = self._spill(name, reason, group)
        self.prefixes.record(hashes, name)
        return name, reason

    def _spill(self, name: str, reason: str, candidates: list[str]) -> tuple[str, str]:
        bound = self.options.spill_over.max_queue_wait_s
        if bound is None or self.load.queue_wait(name) <= bound:
            return name, reason
        waits = sorted((self.load.queue_wait(c), i, c) for i, c in enumerate(candidates) if c != name)
        if waits and waits[0][0] < bound:
            return waits[0][2], "spill"
        return name, reason

    async def track(self, route: Route, outputs: AsyncIterator, request_id: str) -> AsyncIterator:
        """Pass a request's outputs through: its engine's load while it runs, and its replay, queued
        once it finished (if sampled). Closing this closes `outputs`."""
        ticket = self.load.start(route.name)
        output_ids: list[int] = []
        finished = False
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    if output.token_ids:
                        self.load.first_output(ticket)
                        output_ids += output.token_ids
                    finished = output.finished and output.finish_reason != "abort"
                    yield output
        finally:
            self.load.finish(ticket)
            if finished and route.shadow is not None and output_ids:
                full = self.shadow.pairs[route.shadow].full
                job = ShadowJob(
                    quant=route.shadow,
                    full=full,
                    request_id=request_id,
                    answered_by=route.name,
                    token_ids=route.prompt_ids + output_ids,
                    num_prompt_tokens=len(route.prompt_ids),
                )
                self.shadow.submit(job)

    @property
    def is_running(self) -> bool:
        return all(engine.is_running for engine in self.engines.values())

    def stats(self):
        """All engines' stats as one (the server's unlabelled metrics): counts add up, usage is
        weighted by each engine's KV blocks."""
        return combined_stats([engine.stats() for engine in self.engines.values()])

    def shutdown(self) -> None:
        if self.shadow is not None:
            self.shadow.close()
        for engine in self.engines.values():
            engine.shutdown()


def combined_stats(stats: list):
    """Counts (ints) add up; fractions named *_usage are weighted by each engine's KV blocks; other
    floats (rates, means) are averaged; anything else is kept when every engine agrees, else None."""
    if len(stats) == 1:
        return stats[0]
    blocks = sum(s.num_kv_blocks for s in stats)
    values = {}
    for f in dataclasses.fields(stats[0]):
        parts = [getattr(s, f.name) for s in stats]
        if all(isinstance(p, bool) or not isinstance(p, int | float) for p in parts):
            values[f.name] = parts[0] if all(p == parts[0] for p in parts) else None
        elif all(isinstance(p, int) for p in parts):
            values[f.name] = sum(parts)
        elif f.name.endswith("_usage"):
            values[f.name] = sum(p * s.num_kv_blocks for p, s in zip(parts, stats, strict=True)) / max(blocks, 1)
        else:
            values[f.name] = sum(parts) / len(parts)
    return type(stats[0])(**values)
