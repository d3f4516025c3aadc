"""Run an artifact and its base over an eval set, token for token, and score the difference."""

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.errors import OptkitError
from optkit.gate.decision import EXIT_CODES, Decision, decide
from optkit.gate.intervals import Bootstrap, bootstrap_items, bootstrap_windows
from optkit.gate.metrics import Reference, TokenStats, WindowStats, kld_histogram, reference_from_logits, summarize
from optkit.gate.options import GateOptions
from optkit.gate.outside_runtime import outside_model
from optkit.gate.power import plan as power_plan
from optkit.gate.power import spreads
from optkit.gate.reference_cache import (
    load_cached_value,
    load_reference,
    reference_key,
    save_cached_value,
    save_reference,
)
from optkit.gate.sequential_run import add_answers, drawing_order, new_gate, score_until_decided, sequential_decision
from optkit.gate.tasks import encode_task, item_correct, load_task
from optkit.gate.thresholds import Check
from optkit.json_strict import finite
from optkit.modeldir import load_tokenizer, read_config, resolve_model_dir
from optkit.progress import progress_bar
from optkit.quant.formats import file_format
from optkit.quant.formats.load import load_model


@dataclass
class GateResult:
    artifact: str
    baseline: str
    eval_set: dict
    metrics: dict[str, float]
    checks: list[Check] = field(default_factory=list)
    kld_histogram: dict = field(default_factory=dict)
    wall_time_s: float = 0.0
    decision: Decision | None = None  # None: the point rule on `checks`
    intervals: dict = field(default_factory=dict)  # Bootstrap.to_json(): two-sided, per metric
    plan: dict = field(default_factory=dict)  # gate/power.py: what this eval set can resolve
    windows: WindowStats | None = None  # per-window sums, in the order scored (`--compare`, report.html)
    answers: tuple[torch.Tensor, torch.Tensor] | None = None  # task: (base, artifact) correct per question
    sequential: dict = field(default_factory=dict)  # --sequential: the bets (gate/sequential.py)
    engine: dict = field(default_factory=dict)  # what ran the artifact: {"name": "vllm", "dtype": ...}

    @property
    def verdict(self) -> str:
        """pass | fail | inconclusive | report_only (no threshold was set)."""
        if self.decision is not None:
            return self.decision.verdict
        if not self.checks:
            return "report_only"
        return "pass" if all(c.passed for c in self.checks) else "fail"

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self) -> dict:
        decision = None
        if self.decision is not None:
            decision = self.decision.to_json(self.eval_set.get("windows"), self.eval_set.get("task_questions"))
        return finite(
            {
                "artifact": self.artifact,
                "baseline": self.baseline,
                "eval_set": self.eval_set,
                "metrics": self.metrics,
                "intervals": self.intervals,
                "checks": [{**c.__dict__, "rule": c.rule} for c in self.checks],
                "verdict": self.verdict,
                "decision": decision,
                "plan": self.plan,
                "kld_histogram": self.kld_histogram,
                "window_kld": [] if self.windows is None else (self.windows.kld / self.windows.tokens).tolist(),
                **({"sequential": self.sequential} if self.sequential else {}),
                **({"engine": self.engine} if self.engine else {}),
                "wall_time_s": self.wall_time_s,
            }
        )


@runtime_checkable
class GatheringModel(Protocol):
    """An artifact model run by an outside engine that returns log Q at given ids, not full logits
    (gate/vllm_model.py): the gate asks it only for the base's top-k."""

    def gather(self, windows: torch.Tensor, ids: torch.Tensor): ...  # -> engines.vllm.Gathered


def score_windows(
    artifact_model,
    windows: torch.Tensor,
    *,
    base_model=None,
    reference: Reference | None = None,
    top_k: int | None = None,
    batch_size: int = 8,
    advance=None,
) -> tuple[TokenStats, Reference | None]:
    """Score the artifact on `windows` [N, T] against the base: from `reference` (the base's cached
    top-k for exactly these windows, in order) when given; else `base_model` runs, and with `top_k`
    its top-k is also returned (to cache) and the KLD taken over it, as reruns from the cache will.
    advance(n): called after each batch of n windows (a progress bar)."""
    stats = TokenStats()
    parts = []
    with torch.inference_mode():
        for first in range(0, len(windows), batch_size):
            batch = windows[first : first + batch_size]
            if reference is not None:  # the base never runs: its top-k comes from the cache
                base = reference[first : first + batch_size]
            elif top_k is not None:  # first run with the cache: build it, score the way reruns will
                base = reference_from_logits(base_model(batch).logits, batch, top_k)
                parts.append(base)
            else:
                base = None
            _score_batch(stats, artifact_model, batch, base, base_model)
            if advance is not None:
                advance(len(batch))
    return stats, Reference.cat(parts) if parts else None


def _score_batch(stats: TokenStats, artifact_model, batch: torch.Tensor, base: Reference | None, base_model) -> None:
    if base is None:  # exact, over the whole vocabulary
        artifact_logits = artifact_model(batch).logits
        stats.add(base_model(batch).logits, artifact_logits, batch)
    elif isinstance(artifact_model, GatheringModel):  # log Q at the base's top-k ids only
        found = artifact_model.gather(batch, base.topk_ids)
        stats.add_gathered(base, found.logp_at_ids, found.target_logp, found.argmax, batch)
    else:
        stats.add_reference(base, artifact_model(batch).logits, batch)


def judge(
    metrics: dict[str, float],
    windows: WindowStats,
    answers: tuple[torch.Tensor, torch.Tensor] | None,
    options: GateOptions,
    *,
    eval_windows: int | None = None,
) -> tuple[Decision, Bootstrap, dict]:
    """The decision, the bootstrap behind it and the plan, from what was scored: per-window sums
    and, with a task, (base correct, artifact correct) per question. eval_windows: the windows
    the configured eval set holds (default: those scored)."""
    bounds = bootstrap_windows(windows, seed=options.bootstrap_seed)
    if answers is not None:
        bounds = bounds | bootstrap_items(*answers, seed=options.bootstrap_seed)
    decision = decide(metrics, options, rule=options.decision, bounds=bounds, alpha=options.alpha)
    eval_items = answers[0].numel() if answers is not None else None
    plan = power_plan(
        spreads(windows, answers),
        options,
        eval_windows=eval_windows or len(windows),
        eval_items=eval_items,
        alpha=options.alpha,
    )
    return decision, bounds, plan


def evaluate(
    artifact: str | Path,
    baseline: str | Path,
    options: GateOptions,
    *,
    batch_size: int = 8,
    artifact_model=None,
    engine: dict | None = None,
    pilot_windows: int | None = None,
) -> GateResult:
    """Score `artifact` against `baseline` on the token windows of `options.eval_set`: exactly over
    the whole vocabulary, or, with `reference_cache`, against the base's cached top-k log-probs (the
    base model is then loaded only the first time); then decide on `options`' thresholds.
    artifact_model: what runs the artifact instead of transformers (`optkit eval --engine optkit`
    passes the runtime's paged model, models/paged_lm.py; `--engine vllm` gate/vllm_model.py):
    input_ids [B, S] -> .logits; `engine` is what the report says of it (its name, dtype...).
    pilot_windows: `optkit eval --plan`: score only this many windows, drawn at random (seeded) from
    the configured set, and plan the whole set from them; the verdict is then report_only."""
    start = time.perf_counter()
    one_file = file_format(artifact)  # a .gguf runs in its format's runtime (llama.cpp), the rest in transformers
    artifact_dir = Path(artifact) if one_file else resolve_model_dir(artifact)
    baseline_dir = resolve_model_dir(baseline)
    texts = load_text_set(options.eval_set)
    tokenizer = load_tokenizer(baseline_dir)
    tokens, windows, configured = _eval_windows(options, tokenizer, texts, pilot_windows)
    _check_vocabulary(baseline_dir, artifact_dir, one_file)
    key = reference_key(baseline_dir, windows, options.top_k) if options.reference_cache else None
    reference = load_reference(key) if key else None
    if artifact_model is None:
        artifact_model = (
            outside_model(one_file, artifact_dir, options.seq_len) if one_file else load_model(artifact_dir)
        )
        engine = {"name": one_file.runtime if one_file else "transformers"}
    base_model = load_model(baseline_dir) if reference is None else None
    scorer = _Scorer(artifact_model, base_model, reference, key, options.top_k if options.reference_cache else None)
    bets = new_gate(options, options.alpha) if options.sequential else None
    stats, windows, built = _score(scorer, windows, options, bets, batch_size)
    if built is not None:
        save_reference(key, built)

    metrics = summarize(stats)
    answers = None
    if options.task is not None:
        answers, base_model = _task_answers(options.task, tokenizer, key, scorer, baseline_dir)
        metrics |= _task_metrics(answers)
    if one_file:
        artifact_model.close()
    window_stats = WindowStats.of(stats)
    decision, bounds, plan = _decide(metrics, window_stats, answers, options, configured, bets, pilot_windows)
    return GateResult(
        artifact=str(artifact_dir),
        baseline=str(baseline_dir),
        eval_set={
            "name": options.eval_set,
            "sha256": texts.sha256,
            "seq_len": options.seq_len,
            "windows": len(windows),
            "windows_available": tokens.numel() // options.seq_len,  # the whole set, without max_windows
            "kld": f"top-{options.top_k} + tail" if options.reference_cache else "full vocabulary",
            "base_model_loaded": base_model is not None,
            **({"task_questions": answers[0].numel()} if answers is not None else {}),
            **({"pilot_of": configured} if pilot_windows is not None else {}),
        },
        metrics=metrics,
        checks=decision.checks,
        kld_histogram=kld_histogram(stats),
        wall_time_s=round(time.perf_counter() - start, 3),
        decision=decision,
        intervals=bounds.to_json(options.confidence),
        plan=plan,
        windows=window_stats,
        answers=answers,
        sequential=bets.to_json() | {"windows_available": configured} if bets is not None else {},
        engine=engine or {},
    )


def _eval_windows(options: GateOptions, tokenizer, texts, pilot_windows: int | None):
    """The eval set's tokens, the windows to score (a seeded pilot of them with --plan) and how
    many windows the configured set holds."""
    if options.seq_len < 2:
        raise OptkitError(f"--seq-len {options.seq_len} is too short: at least 2 tokens are needed to predict one")
    tokens = tokenize_stream(tokenizer, texts.texts)
    windows = pack_windows(tokens, options.seq_len, options.max_windows)
    if len(windows) == 0:
        raise OptkitError(
            f"--eval-set {options.eval_set!r} is shorter than one window of {options.seq_len} tokens: "
            "give more text or a smaller --seq-len"
        )
    configured = len(windows)
    if pilot_windows is not None and pilot_windows < configured:
        generator = torch.Generator().manual_seed(options.bootstrap_seed)
        windows = windows[torch.randperm(configured, generator=generator)[:pilot_windows].sort().values]
    return tokens, windows, configured


def _check_vocabulary(baseline_dir: Path, artifact_dir: Path, one_file) -> None:
    base_vocab = read_config(baseline_dir)["vocab_size"]
    artifact_vocab = (one_file.file_config if one_file else read_config)(artifact_dir)["vocab_size"]
    if base_vocab != artifact_vocab:
        raise OptkitError(
            f"artifact vocabulary ({artifact_vocab}) differs from the baseline's ({base_vocab}): "
            "compare an artifact with the model it was made from"
        )


@dataclass
class _Scorer:
    """The artifact and what it is compared with: the base model or its cached top-k (`key`);
    top_k: build and cache the base's top-k where it is not cached yet."""

    artifact_model: object
    base_model: object
    reference: Reference | None
    key: object  # reference_cache.ReferenceKey | None
    top_k: int | None

    def windows_at(self, windows: torch.Tensor, index: torch.Tensor, batch_size: int) -> TokenStats:
        """--sequential: the windows at index."""
        cached = self.reference[index] if self.reference is not None else None
        part, built = score_windows(
            self.artifact_model,
            windows[index],
            base_model=self.base_model,
            reference=cached,
            top_k=self.top_k if cached is None else None,
            batch_size=batch_size,
        )
        if built is not None:
            save_reference(self.key.select(index), built)
        return part


def _score(scorer: _Scorer, windows: torch.Tensor, options: GateOptions, bets, batch_size: int):
    """Every window, or with `bets` (--sequential) windows in a seeded random order until every
    threshold is decided: (stats, the windows scored, the base's top-k built to cache or None)."""
    with progress_bar() as bar:
        progress_task = bar.add_task("gate", total=len(windows), info=f"{options.eval_set}, {windows.numel():,} tokens")

        def advance(n: int) -> None:
            bar.update(progress_task, advance=n)

        if bets is not None:
            order = drawing_order(len(windows), options.bootstrap_seed)

            def some(index: torch.Tensor) -> TokenStats:
                return scorer.windows_at(windows, index, batch_size)

            stats, used = score_until_decided(order, some, bets, batch_size=batch_size, advance=advance)
            return stats, windows[used], None
        stats, built = score_windows(
            scorer.artifact_model,
            windows,
            base_model=scorer.base_model,
            reference=scorer.reference,
            top_k=scorer.top_k if scorer.reference is None else None,
            batch_size=batch_size,
            advance=advance,
        )
    return stats, windows, built


def _task_answers(task: str, tokenizer, key, scorer: _Scorer, baseline_dir: Path):
    """(base correct, artifact correct) per question, the base's from the cache where it can, and
    the base model (loaded here when the base's answers were not cached)."""
    records = load_task(task)
    encoded = encode_task(tokenizer, records)
    pad_id = tokenizer.eos_token_id or 0
    # the base's answers, one 0/1 per question (the task intervals pair them with the artifact's)
    records_hash = hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]
    task_key = f"{key.base}-task-{records_hash}-answers" if key else None
    base_correct = _cached_answers(task_key, len(encoded)) if task_key else None
    base_model = scorer.base_model
    if base_correct is None:
        base_model = base_model if base_model is not None else load_model(baseline_dir)
        base_correct = item_correct(base_model, encoded, pad_id)
        if task_key:
            save_cached_value(task_key, base_correct.int().tolist())
    artifact_correct = item_correct(scorer.artifact_model, encoded, pad_id)
    return (base_correct, artifact_correct), base_model


def _task_metrics(answers: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    base, artifact = (a.double().mean().item() for a in answers)
    return {"task_acc_base": base, "task_acc_artifact": artifact, "task_recovery": artifact / max(base, 1e-12)}


def _decide(metrics, window_stats: WindowStats, answers, options: GateOptions, configured: int, bets, pilot):
    """judge(), then --sequential's bets decide instead, and a --plan pilot decides nothing."""
    decision, bounds, plan = judge(metrics, window_stats, answers, options, eval_windows=configured)
    if bets is not None:
        if answers is not None:
            add_answers(bets, answers, options.bootstrap_seed)
        decision = sequential_decision(bets, metrics, options)
    if pilot is not None:  # a plan, not a verdict: the pilot is too small to judge on
        decision = Decision("report_only", options.decision, options.alpha, [], reason="--plan: a pilot, no verdict")
    return decision, bounds, plan


def _cached_answers(key: str, questions: int) -> torch.Tensor | None:
    value = load_cached_value(key)
    if not isinstance(value, list) or len(value) != questions or any(v not in (0, 1) for v in value):
        return None  # absent, damaged or from another task: recomputed, never trusted
    return torch.tensor(value, dtype=torch.bool)
