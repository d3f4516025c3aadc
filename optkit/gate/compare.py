"""Two artifacts of one base on the same windows: which is better, and by how much, with an error
rate (`optkit eval A --compare B --baseline BASE`). Pure math, and the table that shows it.

Windows: each metric's difference is itself a ratio of per-window sums, so it is bootstrapped as
the gate's own metrics are (intervals.py: paired bootstrap-t over whole windows), the two
artifacts' values staying together in every resample:
  kld_mean          y = Σ KLD_A − Σ KLD_B            t = tokens   A − B, nats
  top1_pct          y = top1_A − top1_B (tokens)     t = tokens   A − B, percentage points
  ppl_increase_pct  y = Σ NLL_A − Σ NLL_B            t = tokens   100 (ppl_A / ppl_B − 1), %: A's
                                                                  perplexity over B's (≈ the
                                                                  difference of their increases)
The p-value tests "no difference" (0 on each scale) two-sided by the same bootstrap-t, so that it
is below 1 − confidence exactly when the interval leaves 0 out:
  p = P*(|t*| ≥ |t₀|),  t₀ = θ̂ / ŝe,  with one added to the count (never 0): the symmetric
  bootstrap-t test, as the interval is symmetric.
Task questions: the accuracy difference a − b per question with its bootstrap-t interval, and
McNemar's exact test (McNemar 1947): under "equally good" the questions only one of the two gets
right split 50:50, so with n₁₀ (A right, B wrong) and n₀₁ (the reverse)
  p = min(1, 2 P(Bin(n₁₀ + n₀₁, 1/2) ≤ min(n₁₀, n₀₁))).
"""

import math
from dataclasses import asdict, dataclass

import torch

from optkit.gate.intervals import ANY, RESAMPLES, bootstrap_ratios, identity, percent, ppl_percent
from optkit.gate.metrics import WindowStats

LABELS = {
    "kld_mean": ("KL divergence, mean", "nats", "{:+.5f}"),
    "ppl_increase_pct": ("perplexity increase", "%", "{:+.3f}"),  # A − B: 100 (ppl_A / ppl_B − 1)
    "top1_pct": ("same top token", "points", "{:+.2f}"),
    "task_acc_artifact": ("task accuracy", "%", "{:+.2f}"),
}
LOWER_IS_BETTER = {"kld_mean": True, "ppl_increase_pct": True, "top1_pct": False, "task_acc_artifact": False}


@dataclass(frozen=True)
class Difference:
    metric: str
    a: float  # A's metric (for ppl_increase_pct: A's perplexity increase over the base, %)
    b: float
    difference: float  # A − B on the scale of LABELS
    low: float
    high: float
    p_value: float
    units: int  # windows, or task questions
    test: str

    @property
    def better(self) -> str:
        """'A', 'B' or '' (not shown at this confidence: the interval holds 0)."""
        if self.low <= 0 <= self.high:
            return ""
        return "A" if (self.difference < 0) == LOWER_IS_BETTER[self.metric] else "B"


def bootstrap_p_value(estimate: float, se: float, t_star: torch.Tensor) -> float:
    """Two-sided bootstrap-t p-value of "θ = 0" (module doc); t_star [B]."""
    if se <= 0:
        return 1.0 if estimate == 0 else 0.0
    t0 = abs(estimate / se)  # symmetric, as the interval: p < 1 − confidence ⟺ 0 lies outside it
    return min(1.0, ((t_star.abs() >= t0).sum().item() + 1) / (t_star.numel() + 1))


def mcnemar_exact(a_correct: torch.Tensor, b_correct: torch.Tensor) -> float:
    """McNemar's exact two-sided p-value on paired 0/1 answers [n] (module doc)."""
    a, b = a_correct.bool(), b_correct.bool()
    only_a, only_b = int((a & ~b).sum()), int((~a & b).sum())
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


def compare_windows(
    a: WindowStats, b: WindowStats, *, confidence: float = 0.95, resamples: int = RESAMPLES, seed: int = 0
) -> list[Difference]:
    """A − B per window metric, from both artifacts' sums on the same windows in the same order."""
    if not torch.equal(a.tokens, b.tokens) or not torch.allclose(a.nll_base, b.nll_base, rtol=1e-6, atol=1e-6):
        raise ValueError("the two artifacts were not scored on the same windows of the same base")
    tokens = a.tokens.double()
    ratios = {
        "kld_mean": ((a.kld - b.kld).double(), tokens, identity, ANY),
        "ppl_increase_pct": ((a.nll_artifact - b.nll_artifact).double(), tokens, ppl_percent, ANY),
        "top1_pct": ((a.top1 - b.top1).double(), tokens, percent, ANY),
    }
    single = {
        "kld_mean": lambda s: (s.kld.sum() / s.tokens.sum()).item(),
        "ppl_increase_pct": lambda s: 100 * math.expm1(((s.nll_artifact - s.nll_base).sum() / s.tokens.sum()).item()),
        "top1_pct": lambda s: (100 * s.top1.sum() / s.tokens.sum()).item(),
    }
    boot = bootstrap_ratios(ratios, resamples, seed)
    return [_difference(metric, single[metric](a), single[metric](b), boot, confidence) for metric in ratios]


def compare_items(
    a_correct: torch.Tensor,
    b_correct: torch.Tensor,
    *,
    confidence: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Difference:
    """Task accuracy of A − B on the same questions, in points, with McNemar's exact p-value."""
    if a_correct.shape != b_correct.shape:
        raise ValueError(f"{tuple(a_correct.shape)} answers of A against {tuple(b_correct.shape)} of B")
    a, b = a_correct.double(), b_correct.double()
    # where A and B answer alike everywhere, a disagreement may be unseen: one moves the difference by 1/n
    ratios = {"task_acc_artifact": (a - b, torch.ones_like(a), percent, (-1.0, 1.0))}
    boot = bootstrap_ratios(ratios, resamples, seed, {"task_acc_artifact": 1.0 / max(a.numel(), 1)})
    found = _difference("task_acc_artifact", 100 * a.mean().item(), 100 * b.mean().item(), boot, confidence)
    return Difference(**(asdict(found) | {"p_value": mcnemar_exact(a_correct, b_correct), "test": "McNemar exact"}))


def _difference(metric: str, a: float, b: float, boot, confidence: float) -> Difference:
    fit = boot.metrics[metric]
    low, high = boot.interval(metric, confidence)
    p = bootstrap_p_value(fit.estimate, fit.se, fit.t_star)
    return Difference(metric, a, b, fit.value(), low, high, p, fit.units, "paired bootstrap-t")


def to_json(differences: list[Difference], confidence: float) -> dict:
    return {
        "confidence": confidence,
        "metrics": {d.metric: asdict(d) | {"better": d.better, "unit": LABELS[d.metric][1]} for d in differences},
    }


def comparison_table(comparison: dict, a: str, b: str):
    """`to_json`'s comparison as a rich table: one row per metric."""
    from rich.table import Table

    confidence = comparison["confidence"]
    table = Table(title=f"A − B, {confidence:.0%} interval: A = {a}, B = {b}")
    for column in ("metric", "A", "B", "A − B", "interval", "p", "test", "better"):
        table.add_column(column, justify="left" if column in ("metric", "test") else "right")
    for metric, d in comparison["metrics"].items():
        label, unit, fmt = LABELS[metric]
        plain = fmt.replace("+", "")
        table.add_row(
            f"{label} ({unit})",
            plain.format(d["a"]),
            plain.format(d["b"]),
            fmt.format(d["difference"]),
            f"[{fmt.format(d['low'])}, {fmt.format(d['high'])}]",
            f"{d['p_value']:.2g}",
            d["test"],
            d["better"] or "neither",
        )
    return table
