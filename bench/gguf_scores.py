"""GGUF files scored in llama.cpp against a full-precision GGUF also run in llama.cpp: every file
sees the same token windows (the gate's `heldout` windows, tokenized by the model's tokenizer), so
per window it has a summed NLL, a summed full-vocabulary KLD against the full-precision file's
distribution and a count of positions where the top token agrees. The files are loaded together and
scored window by window, so the base's log-probabilities are computed once and never stored.
"""

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.gate.llama_cpp import LlamaCppModel
from optkit.modeldir import load_tokenizer, resolve_model_dir

Z_95 = 1.959964


def eval_windows(model: str, eval_set: str, seq_len: int, max_windows: int | None) -> torch.Tensor:
    """The gate's windows of `eval_set` for `model`: [windows, seq_len] token ids."""
    tokens = tokenize_stream(load_tokenizer(resolve_model_dir(model)), load_text_set(eval_set).texts)
    return pack_windows(tokens, seq_len, max_windows)


@dataclass
class WindowScores:
    """Per window, summed over its predicted tokens."""

    nll: list[float] = field(default_factory=list)
    kld: list[float] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, log_p: torch.Tensor, log_q: torch.Tensor, targets: torch.Tensor) -> None:
        """log_p (the base's), log_q [T, V] log-probabilities at the positions predicting targets [T]."""
        self.nll.append(-log_q.gather(-1, targets.unsqueeze(-1)).sum().item())
        self.kld.append((log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0).sum().item())
        self.top1.append(int((log_p.argmax(-1) == log_q.argmax(-1)).sum()))
        self.tokens.append(targets.numel())

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.nll) / sum(self.tokens))

    @property
    def kld_mean(self) -> float:
        return sum(self.kld) / sum(self.tokens)

    @property
    def top1_pct(self) -> float:
        return 100 * sum(self.top1) / sum(self.tokens)


def score(base: Path, files: dict[str, Path], windows: torch.Tensor, threads: int) -> dict[str, WindowScores]:
    """Each file's WindowScores against `base`'s logits, and the base's own under its path's name."""
    seq_len = windows.shape[1]
    base_model = LlamaCppModel(base, n_ctx=seq_len, n_threads=threads)
    models = {name: LlamaCppModel(path, n_ctx=seq_len, n_threads=threads) for name, path in files.items()}
    scores = {name: WindowScores() for name in [str(base), *files]}
    try:
        for window in windows:
            row, targets = window.unsqueeze(0), window[1:]
            log_p = torch.log_softmax(base_model(row).logits[0, :-1], dim=-1)
            scores[str(base)].add(log_p, log_p, targets)
            for name, model in models.items():
                scores[name].add(log_p, torch.log_softmax(model(row).logits[0, :-1], dim=-1), targets)
    finally:
        for model in [base_model, *models.values()]:
            model.close()
    return scores


def paired_ppl_ratio(a: WindowScores, b: WindowScores) -> tuple[float, float, float]:
    """ppl(a) / ppl(b) and its 95% interval from the windows' paired NLL differences (normal
    approximation of the mean difference per token; windows of equal length)."""
    diffs = torch.tensor(a.nll, dtype=torch.float64) - torch.tensor(b.nll, dtype=torch.float64)
    per_token = sum(a.tokens) / len(a.tokens)
    mean = diffs.mean().item() / per_token
    half = Z_95 * diffs.std().item() / math.sqrt(len(diffs)) / per_token
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)
