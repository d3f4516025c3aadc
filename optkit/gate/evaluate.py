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
from optkit.gate.metrics import Reference, TokenStats, kld_histogram, reference_from_logits, summarize
from optkit.gate.options import GateOptions
from optkit.gate.reference_cache import (
    load_cached_value,
    load_reference,
    reference_key,
    save_cached_value,
    save_reference,
)
from optkit.gate.tasks import accuracy, encode_task, load_task
from optkit.gate.thresholds import Check, check
from optkit.modeldir import load_tokenizer, read_config, resolve_model_dir
from optkit.progress import progress_bar
from optkit.quant.formats.gguf_read import is_gguf
from optkit.quant.formats.gguf_read import read_config as read_gguf_config
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

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return {
            "artifact": self.artifact,
            "baseline": self.baseline,
            "eval_set": self.eval_set,
            "metrics": self.metrics,
            "checks": [{**c.__dict__, "rule": c.rule} for c in self.checks],
            "verdict": "pass" if self.passed else "fail",
            "kld_histogram": self.kld_histogram,
            "wall_time_s": self.wall_time_s,
        }


def evaluate(
    artifact: str | Path, baseline: str | Path, options: GateOptions, *, batch_size: int = 8, artifact_model=None
) -> GateResult:
    """Score `artifact` against `baseline` on the token windows of `options.eval_set`: exactly over
    the whole vocabulary, or, with `reference_cache`, against the base's cached top-k log-probs (the
    base model is then loaded only the first time); then check `options`' thresholds.
    artifact_model: what runs the artifact instead of transformers (`optkit eval --kv-cache-dtype`
    passes the runtime's paged model, models/paged_lm.py): input_ids [B, S] -> .logits."""
    eval_set, seq_len, max_windows = options.eval_set, options.seq_len, options.max_windows
    reference_cache, top_k, task = options.reference_cache, options.top_k, options.task
    start = time.perf_counter()
    gguf_file = is_gguf(artifact)  # a .gguf is evaluated by llama.cpp, everything else by transformers
    artifact_dir = Path(artifact) if gguf_file else resolve_model_dir(artifact)
    baseline_dir = resolve_model_dir(baseline)
    texts = load_text_set(eval_set)
    tokenizer = load_tokenizer(baseline_dir)
    if seq_len < 2:
        raise OptkitError(f"--seq-len {seq_len} is too short: at least 2 tokens are needed to predict one")
    windows = pack_windows(tokenize_stream(tokenizer, texts.texts), seq_len, max_windows)
    if len(windows) == 0:
        raise OptkitError(
            f"--eval-set {eval_set!r} is shorter than one window of {seq_len} tokens: "
            "give more text or a smaller --seq-len"
        )

    base_vocab = read_config(baseline_dir)["vocab_size"]
    artifact_vocab = (read_gguf_config if gguf_file else read_config)(artifact_dir)["vocab_size"]
    if base_vocab != artifact_vocab:
        raise OptkitError(
            f"artifact vocabulary ({artifact_vocab}) differs from the baseline's ({base_vocab}): "
            "compare an artifact with the model it was made from"
        )
    key = reference_key(baseline_dir, windows, top_k) if reference_cache else None
    reference = load_reference(key) if key else None
    if artifact_model is None:
        artifact_model = _gguf_model(artifact_dir, seq_len) if gguf_file else load_model(artifact_dir)
    base_model = load_model(baseline_dir) if reference is None else None
    stats = TokenStats()
    parts = []
    with torch.inference_mode(), progress_bar() as bar:
        progress_task = bar.add_task("gate", total=len(windows), info=f"{eval_set}, {windows.numel():,} tokens")
        for first in range(0, len(windows), batch_size):
            batch = windows[first : first + batch_size]
            artifact_logits = artifact_model(batch).logits
            if reference is not None:  # the base never runs: its top-k comes from the cache
                stats.add_reference(reference[first : first + batch_size], artifact_logits, batch)
            elif reference_cache:  # first run with the cache: build it, score the way reruns will
                parts.append(reference_from_logits(base_model(batch).logits, batch, top_k))
                stats.add_reference(parts[-1], artifact_logits, batch)
            else:
                stats.add(base_model(batch).logits, artifact_logits, batch)
            bar.update(progress_task, advance=len(batch))
    if parts:
        save_reference(key, Reference.cat(parts))

    metrics = summarize(stats)
    if task is not None:
        records = load_task(task)
        encoded = encode_task(tokenizer, records)
        pad_id = tokenizer.eos_token_id or 0
        task_key = f"{key}-task-{hashlib.sha256(json.dumps(records).encode()).hexdigest()[:16]}" if key else None
        base_accuracy = load_cached_value(task_key) if task_key else None
        if base_accuracy is None:
            base_model = base_model if base_model is not None else load_model(baseline_dir)
            base_accuracy = accuracy(base_model, encoded, pad_id)
            if task_key:
                save_cached_value(task_key, base_accuracy)
        metrics["task_acc_base"] = base_accuracy
        metrics["task_acc_artifact"] = accuracy(artifact_model, encoded, pad_id)
        metrics["task_recovery"] = metrics["task_acc_artifact"] / max(metrics["task_acc_base"], 1e-12)
    if gguf_file:
        artifact_model.close()
    return GateResult(
        artifact=str(artifact_dir),
        baseline=str(baseline_dir),
        eval_set={
            "name": eval_set,
            "sha256": texts.sha256,
            "seq_len": seq_len,
            "windows": len(windows),
            "kld": f"top-{top_k} + tail" if reference_cache else "full vocabulary",
            "base_model_loaded": base_model is not None,
        },
        metrics=metrics,
        checks=check(metrics, options),
        kld_histogram=kld_histogram(stats),
        wall_time_s=round(time.perf_counter() - start, 3),
    )


def _gguf_model(path: Path, seq_len: int):
    """llama.cpp with a context long enough for the windows and the task's questions."""
    from optkit.gate.llama_cpp import LlamaCppModel

    context = read_gguf_config(path)["max_position_embeddings"] or 2048
    return LlamaCppModel(path, n_ctx=max(seq_len, min(context, 2048)))
