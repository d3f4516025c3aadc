"""Run an artifact and its base over an eval set, token for token, and score the difference."""

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

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
                "wall_time_s": self.wall_time_s,
            }
        )


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
            artifact_logits = artifact_model(batch).logits
            if reference is not None:  # the base never runs: its top-k comes from the cache
                stats.add_reference(reference[first : first + batch_size], artifact_logits, batch)
            elif top_k is not None:  # first run with the cache: build it, score the way reruns will
                parts.append(reference_from_logits(base_model(batch).logits, batch, top_k))
                stats.add_reference(parts[-1], artifact_logits, batch)
            else:
                stats.add(base_model(batch).logits, artifact_logits, batch)
            if advance is not None:
                advance(len(batch))
    return stats, Reference.cat(parts) if parts else None


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
    pilot_windows: int | None = None,
) -> GateResult:
    """Score `artifact` against `baseline` on the token windows of `options.eval_set`: exactly over
    the whole vocabulary, or, with `reference_cache`, against the base's cached top-k log-probs (the
    base model is then loaded only the first time); then decide on `options`' thresholds.
    artifact_model: what runs the artifact instead of transformers (`optkit eval --kv-cache-dtype`
    passes the runtime's paged model, models/paged_lm.py): input_ids [B, S] -> .logits.
    pilot_windows: `optkit eval --plan`: score only this many windows, drawn at random (seeded) from
    the configured set, and plan the whole set from them; the verdict is then report_only."""
    eval_set, seq_len, max_windows = options.eval_set, options.seq_len, options.max_windows
    reference_cache, top_k, task = options.reference_cache, options.top_k, options.task
    start = time.perf_counter()
    one_file = file_format(artifact)  # a .gguf runs in its format's runtime (llama.cpp), the rest in transformers
    artifact_dir = Path(artifact) if one_file else resolve_model_dir(artifact)
    baseline_dir = resolve_model_dir(baseline)
    texts = load_text_set(eval_set)
    tokenizer = load_tokenizer(baseline_dir)
    if seq_len < 2:
        raise OptkitError(f"--seq-len {seq_len} is too short: at least 2 tokens are needed to predict one")
    tokens = tokenize_stream(tokenizer, texts.texts)
    windows = pack_windows(tokens, seq_len, max_windows)
    if len(windows) == 0:
        raise OptkitError(
            f"--eval-set {eval_set!r} is shorter than one window of {seq_len} tokens: "
            "give more text or a smaller --seq-len"
        )
    configured = len(windows)
    if pilot_windows is not None and pilot_windows < configured:
        generator = torch.Generator().manual_seed(options.bootstrap_seed)
        windows = windows[torch.randperm(configured, generator=generator)[:pilot_windows].sort().values]

    base_vocab = read_config(baseline_dir)["vocab_size"]
    artifact_vocab = (one_file.file_config if one_file else read_config)(artifact_dir)["vocab_size"]
    if base_vocab != artifact_vocab:
        raise OptkitError(
            f"artifact vocabulary ({artifact_vocab}) differs from the baseline's ({base_vocab}): "
            "compare an artifact with the model it was made from"
        )
    key = reference_key(baseline_dir, windows, top_k) if reference_cache else None
    reference = load_reference(key) if key else None
    if artifact_model is None:
        artifact_model = outside_model(one_file, artifact_dir, seq_len) if one_file else load_model(artifact_dir)
    base_model = load_model(baseline_dir) if reference is None else None
    bets = new_gate(options, options.alpha) if options.sequential else None

    def score_batch(index: torch.Tensor) -> TokenStats:  # --sequential: the windows at index
        cached = reference[index] if reference is not None else None
        part, built = score_windows(
            artifact_model,
            windows[index],
            base_model=base_model,
            reference=cached,
            top_k=top_k if reference_cache and cached is None else None,
            batch_size=batch_size,
        )
        if built is not None:
            save_reference(key.select(index), built)
        return part

    with progress_bar() as bar:
        progress_task = bar.add_task("gate", total=len(windows), info=f"{eval_set}, {windows.numel():,} tokens")

        def advance(n: int) -> None:
            bar.update(progress_task, advance=n)

        if bets is not None:
            order = drawing_order(len(windows), options.bootstrap_seed)
            stats, used = score_until_decided(order, score_batch, bets, batch_size=batch_size, advance=advance)
            windows, built = windows[used], None
        else:
            stats, built = score_windows(
                artifact_model,
                windows,
                base_model=base_model,
                reference=reference,
                top_k=top_k if reference_cache and reference is None else None,
                batch_size=batch_size,
                advance=advance,
            )
    if built is not None:
        save_reference(key, built)

    metrics = summarize(stats)
    answers = None
    if task is not None:
        records = load_task(task)
        encoded = encode_task(tokenizer, records)
        pad_id = tokenizer.eos_token_id or 0
        # the base's answers, one 0/1 per question (the task intervals pair them with the artifact's)
        records_hash = hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]
        task_key = f"{key.base}-task-{records_hash}-answers" if key else None
        base_correct = _cached_answers(task_key, len(encoded)) if task_key else None
        if base_correct is None:
            base_model = base_model if base_model is not None else load_model(baseline_dir)
            base_correct = item_correct(base_model, encoded, pad_id)
            if task_key:
                save_cached_value(task_key, base_correct.int().tolist())
        artifact_correct = item_correct(artifact_model, encoded, pad_id)
        answers = (base_correct, artifact_correct)
        metrics["task_acc_base"] = base_correct.double().mean().item()
        metrics["task_acc_artifact"] = artifact_correct.double().mean().item()
        metrics["task_recovery"] = metrics["task_acc_artifact"] / max(metrics["task_acc_base"], 1e-12)
    if one_file:
        artifact_model.close()
    window_stats = WindowStats.of(stats)
    decision, bounds, plan = judge(metrics, window_stats, answers, options, eval_windows=configured)
    if bets is not None:
        if answers is not None:
            add_answers(bets, answers, options.bootstrap_seed)
        decision = sequential_decision(bets, metrics, options)
    if pilot_windows is not None:  # a plan, not a verdict: the pilot is too small to judge on
        decision = Decision("report_only", options.decision, options.alpha, [], reason="--plan: a pilot, no verdict")
    return GateResult(
        artifact=str(artifact_dir),
        baseline=str(baseline_dir),
        eval_set={
            "name": eval_set,
            "sha256": texts.sha256,
            "seq_len": seq_len,
            "windows": len(windows),
            "windows_available": tokens.numel() // seq_len,  # the whole set, without max_windows
            "kld": f"top-{top_k} + tail" if reference_cache else "full vocabulary",
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
    )


def _cached_answers(key: str, questions: int) -> torch.Tensor | None:
    value = load_cached_value(key)
    if not isinstance(value, list) or len(value) != questions or any(v not in (0, 1) for v in value):
        return None  # absent, damaged or from another task: recomputed, never trusted
    return torch.tensor(value, dtype=torch.bool)
