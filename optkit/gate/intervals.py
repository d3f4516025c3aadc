"""Confidence intervals for the gate's metrics: a seeded, paired, studentized bootstrap. Pure math.

Unit of resampling. Tokens inside a window are strongly correlated (one document, one context), so
the bootstrap resamples whole windows: it is the non-overlapping block bootstrap of the token
stream (Carlstein 1986) with the window as the block, valid while a window is long compared with
the range over which tokens depend on each other (the model attends within its window only).
Every gate metric is a ratio of per-unit sums, θ = Σy / Σt, put through a monotone map g:
  kld_mean           y = Σ KLD of the window            t = its tokens   g(θ) = θ
  ppl_increase_pct   y = Σ (NLL_artifact − NLL_base)    t = its tokens   g(θ) = 100 (e^θ − 1)
  top1_pct           y = tokens with the base's top-1   t = its tokens   g(θ) = 100 θ
  task_acc_artifact  y = artifact correct (0/1)         t = 1            g(θ) = θ
  task_recovery      y = artifact correct               t = base correct g(θ) = θ
A resample is a count vector c (how often each unit is drawn, Σc = n), so its θ* = c·y / c·t: B
resamples are one [B, n] count matrix times the columns. The base's and the artifact's NLL (and
answers) stay together in every resample: the bootstrap is paired, so the noise of the text itself
(hard windows are hard for both) cancels out of Δppl and recovery.

Bounds: bootstrap-t (Efron & Tibshirani 1993, ch. 12.5; Hall 1992). With the delta-method standard
error of a ratio, se(θ) = sqrt(n/(n−1) · Σ (y − θ t)²) / Σt, each resample gives
t* = (θ* − θ̂) / se*, and the upper bound at level α is θ̂ − t*_(α) · ŝe (t*_(α): the α-quantile of
t*), the lower θ̂ − t*_(1−α) · ŝe, then mapped by g. A mean KLD over a few windows is right-skewed
(one hard window carries much of the sum): a resample that misses it has a small θ* *and* a small
se*, so t* grows a long left tail and the upper bound moves out, as it must; on skewed windows it
covers the mean more often than BCa and the percentile bound do (docs/results.md), and the upper
bound is the side `--decision confident` passes on.
"""

import math
from dataclasses import dataclass

import torch

from optkit.gate.metrics import WindowStats

RESAMPLES = 2000
CONFIDENCE = 0.95
_CELLS = 4_000_000  # resample × unit counts built at once (32 MB of float64)

WINDOW_METRICS = ("ppl_increase_pct", "kld_mean", "top1_pct")
ANY, POSITIVE, SHARE = (-math.inf, math.inf), (0.0, math.inf), (0.0, 1.0)  # the ranges θ takes
TASK_METRICS = ("task_acc_artifact", "task_recovery")


def identity(x):
    return x


def percent(x):
    return 100.0 * x


def ppl_percent(x):
    return 100.0 * math.expm1(x) if x < 700.0 else math.inf  # a bound from 2 windows may be far out


@dataclass(frozen=True)
class RatioBootstrap:
    """One metric θ = Σy/Σt over n units: its estimate, standard error and the sorted t*."""

    estimate: float  # θ̂, before g
    se: float  # delta-method standard error of θ̂
    t_star: torch.Tensor  # [B] float64, sorted: (θ* − θ̂) / se* per resample
    units: int
    transform: object = identity  # g: θ -> the metric as reported (monotone increasing)
    unseen: float = 0.0  # task metrics: the change in θ one unseen disagreement makes (below)
    floor: float = -math.inf  # the range θ can take (KLD ≥ 0, a share in [0, 1]): bounds stay in it
    ceiling: float = math.inf

    def value(self) -> float:
        return self.transform(self.estimate)

    def quantile(self, level: float) -> float:
        """The bound below which the metric lies with probability `level` (0 < level < 1)."""
        if self.se <= 0.0 or self.units < 2:
            return self._without_spread(level)
        b = self.t_star.numel()
        index = min(max(math.ceil((1.0 - level) * b) - 1, 0), b - 1)  # the (1 − level)-quantile of t*
        theta = self.estimate - self.t_star[index].item() * self.se
        if self.unseen > 0.0:  # 0/1 answers: never tighter than with no disagreement seen at all,
            shift = self._unseen_shift(level)  # as a bootstrap of 1-3 rare flips would be
            theta = min(theta, self.estimate - shift) if level < 0.5 else max(theta, self.estimate + shift)
        return self._clamped(theta)

    def symmetric(self, confidence: float) -> tuple[float, float]:
        """Two-sided interval θ̂ ± q·ŝe, q the `confidence`-quantile of |t*|: the symmetric
        bootstrap-t, whose coverage error is O(n⁻²) against the equal-tailed interval's O(n⁻¹)
        (Hall 1988); on a few skewed windows the equal-tailed one misses on its short side."""
        if self.se <= 0.0 or self.units < 2:
            return self._without_spread((1.0 - confidence) / 2.0), self._without_spread((1.0 + confidence) / 2.0)
        magnitudes = self.t_star.abs().sort().values
        index = min(max(math.ceil(confidence * magnitudes.numel()) - 1, 0), magnitudes.numel() - 1)
        shift = magnitudes[index].item() * self.se
        low, high = self.estimate - shift, self.estimate + shift
        if self.unseen > 0.0:  # as for the one-sided bounds: never tighter than with nothing seen
            unseen = self._unseen_shift((1.0 - confidence) / 2.0)
            low, high = min(low, self.estimate - unseen), max(high, self.estimate + unseen)
        return self._clamped(low), self._clamped(high)

    def _clamped(self, theta: float) -> float:
        return self.transform(min(max(theta, self.floor), self.ceiling))

    def _without_spread(self, level: float) -> float:
        """Every unit agrees (an artifact answering each question as its base does, or all right):
        the bootstrap sees no spread, yet a disagreement may be merely unseen. With none among n
        units, the rate of disagreement is below p = 1 − α^{1/n} at level α (the exact binomial
        bound at zero events, ≈ 3/n at α = 0.05), and θ moves by at most n·p·`unseen`."""
        if self.unseen <= 0.0:
            return self.value()  # windows: an identical artifact has zero KLD on every token
        shift = self._unseen_shift(level)
        return self._clamped(self.estimate - shift if level < 0.5 else self.estimate + shift)

    def _unseen_shift(self, level: float) -> float:
        alpha = min(level, 1.0 - level)
        return self.units * -math.expm1(math.log(alpha) / self.units) * self.unseen


@dataclass(frozen=True)
class Bootstrap:
    """Bounds for each metric of one report."""

    metrics: dict[str, RatioBootstrap]
    resamples: int = RESAMPLES
    seed: int = 0

    def __contains__(self, metric: str) -> bool:
        return metric in self.metrics

    def estimate(self, metric: str) -> float:
        return self.metrics[metric].value()

    def units(self, metric: str) -> int:
        return self.metrics[metric].units

    def upper(self, metric: str, alpha: float) -> float:
        """One-sided upper bound at level alpha: the metric is above it with probability ≈ alpha."""
        return self.metrics[metric].quantile(1.0 - alpha)

    def lower(self, metric: str, alpha: float) -> float:
        return self.metrics[metric].quantile(alpha)

    def interval(self, metric: str, confidence: float = CONFIDENCE) -> tuple[float, float]:
        """The two-sided interval shown (symmetric bootstrap-t); decisions use the one-sided bounds."""
        return self.metrics[metric].symmetric(confidence)

    def to_json(self, confidence: float = CONFIDENCE) -> dict:
        intervals = {}
        for metric in self.metrics:
            low, high = self.interval(metric, confidence)
            intervals[metric] = {"low": low, "high": high, "units": self.units(metric)}
        return {
            "confidence": confidence,
            "method": f"paired symmetric bootstrap-t, {self.resamples} resamples, seed {self.seed}",
            "metrics": intervals,
        }

    def __or__(self, other: "Bootstrap") -> "Bootstrap":
        """The metrics of both (window and task bootstraps are drawn independently)."""
        return Bootstrap(self.metrics | other.metrics, self.resamples, self.seed)


def resample_counts(n: int, resamples: int, generator: torch.Generator):
    """[rows, n] float64 count matrices (how often each unit is drawn), in chunks of rows."""
    rows = max(1, _CELLS // max(n, 1))
    for first in range(0, resamples, rows):
        size = min(rows, resamples - first)
        draws = torch.randint(n, (size, n), generator=generator)
        ones = torch.ones(size, n, dtype=torch.float64)
        yield torch.zeros(size, n, dtype=torch.float64).scatter_add_(1, draws, ones)


def ratio_se(y: torch.Tensor, t: torch.Tensor) -> tuple[float, float]:
    """θ̂ = Σy/Σt and its delta-method standard error over the n units of y, t [n]."""
    n = y.numel()
    theta = (y.sum() / t.sum().clamp(min=1e-12)).item()
    if n < 2:
        return theta, 0.0
    spread = (y - theta * t).square().sum() * n / (n - 1)
    return theta, (spread.sqrt() / t.sum().clamp(min=1e-12)).item()


def bootstrap_ratios(ratios: dict[str, tuple], resamples: int, seed: int, unseen: dict | None = None) -> Bootstrap:
    """ratios: metric -> (y [n], t [n], g, (θ's floor, θ's ceiling)); every metric is resampled
    with the same counts. unseen: metric -> the change in θ one disagreement makes (RatioBootstrap)."""
    n = next(iter(ratios.values()))[0].numel()
    if n == 0:
        raise ValueError("nothing to resample")
    fits = {k: ratio_se(y, t) for k, (y, t, *_) in ratios.items()}
    generator = torch.Generator().manual_seed(seed)
    unseen = unseen or {}
    parts = {k: [] for k in ratios}
    for counts in resample_counts(n, resamples, generator):  # counts [rows, n] @ column [n] -> [rows]
        for k, (y, t, *_) in ratios.items():
            theta, se = fits[k]
            sum_t = (counts @ t).clamp(min=1e-12)
            theta_star = (counts @ y) / sum_t
            # Σc(y − θ*t)² = Σcy² − 2θ* Σcyt + θ*² Σct², without a [rows, n] residual per metric
            spread = counts @ (y * y) - 2 * theta_star * (counts @ (y * t)) + theta_star.square() * (counts @ (t * t))
            se_star = (spread.clamp(min=0) * n / max(n - 1, 1)).sqrt() / sum_t
            floor = 1e-9 * max(se, 1e-300)  # a resample of identical units: its t* is 0 or ±∞
            if k in unseen:  # 0/1 answers: a resample that missed the 1-3 questions that differ has
                # se* = 0; studentized by the sample's ŝe, its t* stays finite instead of filling the
                # tail and collapsing the bound to the metric's floor
                se_star = torch.where(se_star > floor, se_star, torch.full_like(se_star, max(se, floor)))
            parts[k].append((theta_star - theta) / se_star.clamp(min=floor))
    return Bootstrap(
        {
            k: RatioBootstrap(*fits[k], torch.cat(parts[k]).sort().values, n, g, unseen.get(k, 0.0), *limits)
            for k, (_, _, g, limits) in ratios.items()
        },
        resamples,
        seed,
    )


def bootstrap_windows(stats: WindowStats, *, resamples: int = RESAMPLES, seed: int = 0) -> Bootstrap:
    """Paired bootstrap over whole windows of kld_mean, ppl_increase_pct and top1_pct."""
    tokens = stats.tokens.double()
    ratios = {
        "ppl_increase_pct": ((stats.nll_artifact - stats.nll_base).double(), tokens, ppl_percent, ANY),
        "kld_mean": (stats.kld.double(), tokens, identity, POSITIVE),
        "top1_pct": (stats.top1.double(), tokens, percent, SHARE),
    }
    return bootstrap_ratios(ratios, resamples, seed)


def bootstrap_items(
    base_correct: torch.Tensor, artifact_correct: torch.Tensor, *, resamples: int = RESAMPLES, seed: int = 0
) -> Bootstrap:
    """Paired bootstrap over task questions: [n] 0/1 per question for the base and the artifact."""
    if base_correct.shape != artifact_correct.shape:
        raise ValueError(f"{tuple(base_correct.shape)} base answers against {tuple(artifact_correct.shape)}")
    base, artifact = base_correct.double(), artifact_correct.double()
    ratios = {
        "task_acc_artifact": (artifact, torch.ones_like(base), identity, SHARE),
        "task_recovery": (artifact, base, identity, POSITIVE),
    }
    n = base.numel()  # one unseen flip moves accuracy by 1/n and recovery by 1/(questions the base gets)
    unseen = {"task_acc_artifact": 1.0 / max(n, 1), "task_recovery": 1.0 / max(base.sum().item(), 1.0)}
    return bootstrap_ratios(ratios, resamples, seed, unseen)
