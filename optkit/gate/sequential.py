"""Early stopping: a gate that may look after every window and stop once its verdict is certain.
Pure tensor math; the windows' order and the stopping are evaluate.py's.

Method: testing by betting (Waudby-Smith & Ramdas, "Estimating means of bounded random variables
by betting", JRSS-B 86(1), 2024; arXiv:2010.09686), one-sided. Each threshold τ on the mean μ of a
per-window observation x gets two bettors, one per null hypothesis:
  pass side    H: μ ≥ τ   bets on  y = τ − x   (rejecting H passes the threshold)
  reject side  H: μ ≤ τ   bets on  y = x − τ   (rejecting H fails the gate)
Each bettor's capital after t windows is
  K_t = Π_{i≤t} (1 + λ_i y_i),   0 ≤ λ_i ≤ c / w,   λ_i a function of y_1..y_{i−1} only,
where y ≥ −w is the side's bound (below). Under its null E[y_i | past] ≤ 0, so K is a nonnegative
supermartingale and Ville's inequality (1939) bounds the chance that it EVER reaches 1/α:
  P(∃ t: K_t ≥ 1/α) ≤ α,
whatever rule decides when to look or to stop: the verdict may be read after every window.
λ_i is the paper's aGRAPA bet (approximate growth-rate adaptive): λ = m̂ / (σ̂² + m̂²) from
the running mean m̂ and variance σ̂² of y, each with one pseudo-observation y = 0 (at the null)
and variance (w/2)², truncated to [0, c/w] with c = 3/4.

Several thresholds: the gate passes when every pass side has crossed 1/α (an intersection-union
test: no correction), and fails when any reject side crosses m/α for m thresholds (Bonferroni).
It never passes before MIN_PASS_WINDOWS windows (and task questions), like `--decision confident`.

Observations (the gate's windows all have seq_len tokens, so the mean of per-window means is the
gate's ratio of sums; the target is the mean over the population the eval set's windows stand for,
as for the bootstrap intervals):
  max_kld           x = Σ KLD(t) / tokens of the window            x ∈ [0, ∞)
  min_top1          x = share of the window's tokens that keep the base's top token, x ∈ [0, 1]
  max_ppl_increase  x = (Σ NLL_art − Σ NLL_base) / tokens, against τ = log(1 + max_ppl_increase/100)
  min_recovery      x = a − r·b per task question, a, b ∈ {0, 1} the artifact's and the base's
                    answer right, against 0 (E[a] ≥ r·E[b] ⟺ recovery ≥ r), x ∈ [−r, 1]

Bounds. A bettor loses on one side only, so x needs a bound on that side only: the reject side
a lower bound, the pass side an upper bound. Top-1 and the task's x are bounded by definition and
KLD ≥ 0 bounds its reject side. The rest are unbounded, and there the test ASSUMES a bound:
  max_kld pass side:  x ≤ 4τ (BOUND_FACTOR·τ), fixed before any window is seen;
  max_ppl_increase:   τ − 4h ≤ x ≤ τ + 4h, h = max |x − τ| over the first PILOT_WINDOWS windows,
                      which then take no part in the bets (the NLL difference's spread is the
                      text's, not the threshold's, so it is measured; a bound read off the windows
                      it is applied to would void the test).
The assumption is checked as windows come: a window beyond a bound ends that side's bet for the
run (it can no longer decide; the run goes on and ends inconclusive if nothing else decides), so
only windows not yet drawn can break it. On the reference models' artifacts the largest per-window
mean KLD is a small multiple of the mean (docs/results.md): an artifact at its threshold stays
inside 4τ, and one that passes early sits well below τ. Clipping x at the bound instead would
lower the mean the pass side sees, which is not conservative. The bound costs speed rather than
validity: the pass side's bet is capped at
c/(3τ), so even an artifact far inside its threshold takes a few tens of windows. Like any test on
a sample, it cannot see a rare kind of window it has not drawn.
"""

import math
from dataclasses import dataclass, field, replace

import torch

from optkit.gate.decision import MIN_ITEMS, MIN_WINDOWS
from optkit.gate.metrics import WindowStats

BOUND_FACTOR = 4.0  # assumed |x| ≤ 4τ where x has no bound of its own (see above)
MAX_BET = 0.75  # c: a bet never stakes more than 3/4 of what a worst-case window could take
MIN_PASS_WINDOWS, MIN_PASS_ITEMS = MIN_WINDOWS, MIN_ITEMS  # below these, never pass (as `confident`)
PILOT_WINDOWS = 10  # windows that set the NLL difference's bound


def log_capital(y: torch.Tensor, w: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One bettor per row of y [..., T] (H: E[y] ≤ 0; y ≥ −w assumed, w a number or [...]): log K_t
    [..., T] after each observation, and whether the bound has held up to and including t."""
    y = y.double()
    w = torch.as_tensor(w, dtype=torch.float64).unsqueeze(-1)  # [..., 1]
    held = torch.cummin(y >= -w, dim=-1).values
    if y.shape[-1] == 0:
        return y, held
    t = torch.arange(1, y.shape[-1] + 1, dtype=torch.float64)
    # running mean and variance of (0, y_1, ..., y_t) with prior variance (w/2)²; λ_i from those
    # before i (shifted right by one: λ_1 rests on the prior alone and is 0)
    prior = (w / 2).square().nan_to_num(posinf=1e300)
    mean = y.cumsum(-1) / (t + 1)
    variance = (prior + y.square().cumsum(-1) - (t + 1) * mean.square()).clamp(min=0) / (t + 1)
    previous_mean = torch.cat([torch.zeros_like(mean[..., :1]), mean[..., :-1]], -1)
    previous_var = torch.cat([prior.expand_as(variance[..., :1]), variance[..., :-1]], -1)
    cap = torch.where(w > 0, MAX_BET / w.clamp(min=1e-300), math.inf)
    bet = torch.minimum((previous_mean / (previous_var + previous_mean.square())).clamp(min=0.0), cap)
    bet = bet.nan_to_num(nan=0.0)  # 0/0 where every y so far is 0
    factor = 1 + bet * y
    # w ≤ 0 (y ≥ 0 assumed): a single y > 0 refutes E[y] ≤ 0
    factor = torch.where((w <= 0) & (y > 0), math.inf, torch.where(w <= 0, 1.0, factor))
    return factor.clamp(min=1e-300).log().cumsum(-1), held  # factor < 0 only where the bound broke


def first_crossing(y: torch.Tensor, w: float | torch.Tensor, alpha: float, earliest: int = 1) -> torch.Tensor:
    """[...] int64: the first t ≥ earliest (1-based) at which the bettor's capital reached 1/α
    with the bound holding so far; 0 where it never did."""
    if y.shape[-1] == 0:
        return torch.zeros(y.shape[:-1], dtype=torch.int64)
    logk, held = log_capital(y, w)
    t = torch.arange(1, y.shape[-1] + 1)
    crossed = (logk >= math.log(1 / alpha)) & held & (t >= earliest)
    return torch.where(crossed.any(-1), crossed.double().argmax(-1) + 1, 0)


@dataclass(frozen=True)
class Rule:
    """One threshold as a pair of bets on the mean of an observation x with lower ≤ x ≤ upper.
    With `pilot` > 0 the bounds are τ ± BOUND_FACTOR·max|x − τ| over the first `pilot` observations,
    which the bets then skip."""

    name: str  # the threshold's field (max_kld, ...)
    limit: float  # τ on the observation's scale
    below: bool  # True: passing means E[x] ≤ τ (max_*); False: E[x] ≥ τ (min_*)
    lower: float = -math.inf
    upper: float = math.inf
    pilot: int = 0
    unit: str = "windows"  # or "items": the task's questions

    def bounded(self, x: torch.Tensor) -> tuple["Rule", torch.Tensor]:
        """This rule with its bounds set (from the pilot where it has one) and the observations its
        bets see."""
        if not self.pilot:
            return self, x
        if len(x) < self.pilot:
            return self, x[:0]
        half = BOUND_FACTOR * (x[: self.pilot] - self.limit).abs().max().item()
        return replace(self, lower=self.limit - half, upper=self.limit + half, pilot=0), x[self.pilot :]

    @property
    def pass_width(self) -> float:
        """w of the pass side: y = τ − x ≥ τ − upper (max_*), y = x − τ ≥ lower − τ (min_*)."""
        return self.upper - self.limit if self.below else self.limit - self.lower

    @property
    def reject_width(self) -> float:
        return self.limit - self.lower if self.below else self.upper - self.limit

    def pass_y(self, x: torch.Tensor) -> torch.Tensor:
        return self.limit - x if self.below else x - self.limit

    def reject_y(self, x: torch.Tensor) -> torch.Tensor:
        return -self.pass_y(x)


def rules_for(thresholds) -> list[Rule]:
    """A Rule per threshold that is set (a `Thresholds`, or anything with its fields)."""
    rules = []
    if thresholds.max_kld is not None:
        tau = thresholds.max_kld
        rules.append(Rule("max_kld", tau, True, lower=0.0, upper=BOUND_FACTOR * tau))
    if thresholds.max_ppl_increase is not None:
        tau = math.log1p(thresholds.max_ppl_increase / 100)
        rules.append(Rule("max_ppl_increase", tau, True, pilot=PILOT_WINDOWS))
    if thresholds.min_top1 is not None:
        rules.append(Rule("min_top1", thresholds.min_top1 / 100, False, lower=0.0, upper=1.0))
    if thresholds.min_recovery is not None:
        r = thresholds.min_recovery
        rules.append(Rule("min_recovery", 0.0, False, lower=-r, upper=1.0, unit="items"))
    return rules


def window_observations(stats: WindowStats) -> dict[str, torch.Tensor]:
    """Per-window x of each window rule, [W] float64."""
    tokens = stats.tokens.clamp(min=1)
    return {
        "max_kld": stats.kld / tokens,
        "max_ppl_increase": (stats.nll_artifact - stats.nll_base) / tokens,
        "min_top1": stats.top1 / tokens,
    }


def item_observations(base_correct: torch.Tensor, artifact_correct: torch.Tensor, min_recovery: float) -> torch.Tensor:
    return artifact_correct.double() - min_recovery * base_correct.double()


@dataclass
class SequentialGate:
    """The thresholds' bets, fed windows (and task questions) in the order they were drawn."""

    rules: list[Rule]
    alpha: float = 0.05  # the error rate of each verdict: 1 − confidence
    observations: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if not self.rules:
            raise ValueError("a sequential gate needs at least one threshold")
        self.observations = {r.name: torch.zeros(0, dtype=torch.float64) for r in self.rules}

    def add_windows(self, stats: WindowStats) -> None:
        xs = window_observations(stats)
        for rule in self.rules:
            if rule.unit == "windows":
                self.observations[rule.name] = torch.cat([self.observations[rule.name], xs[rule.name]])

    def add_items(self, base_correct: torch.Tensor, artifact_correct: torch.Tensor) -> None:
        for rule in self.rules:
            if rule.unit == "items":
                x = item_observations(base_correct, artifact_correct, -rule.lower)  # lower = −r
                self.observations[rule.name] = torch.cat([self.observations[rule.name], x])

    def count(self, unit: str) -> int:
        return max((len(self.observations[r.name]) for r in self.rules if r.unit == unit), default=0)

    def sides(self) -> dict[str, dict]:
        """Per threshold: when each side crossed (0: not yet), its e-value (capital now), whether
        the bound assumed for it has held."""
        out = {}
        for rule in self.rules:
            observed = len(self.observations[rule.name])
            rule, x = rule.bounded(self.observations[rule.name])
            skipped = observed - len(x)  # the pilot: crossing times count from the first observation
            earliest = max(1, (MIN_PASS_ITEMS if rule.unit == "items" else MIN_PASS_WINDOWS) - skipped)
            pass_y, reject_y = rule.pass_y(x), rule.reject_y(x)
            pass_k, pass_held = log_capital(pass_y, rule.pass_width)
            reject_k, reject_held = log_capital(reject_y, rule.reject_width)
            passed = int(first_crossing(pass_y, rule.pass_width, self.alpha, earliest)) if len(x) else 0
            rejected = int(first_crossing(reject_y, rule.reject_width, self.alpha / len(self.rules))) if len(x) else 0
            out[rule.name] = {
                "unit": rule.unit,
                "observed": observed,
                "passed_at": passed + skipped if passed else 0,
                "rejected_at": rejected + skipped if rejected else 0,
                "pass_evalue": _evalue(pass_k),
                "reject_evalue": _evalue(reject_k),
                "bound_held": bool(pass_held.all() and reject_held.all()),
                "bounds": [b if math.isfinite(b) else None for b in (rule.lower, rule.upper)],
            }
        return out

    def verdict(self, sides: dict[str, dict] | None = None) -> str | None:
        """'fail' once any reject side crossed, 'pass' once every pass side did, else None."""
        sides = sides or self.sides()
        if any(s["rejected_at"] for s in sides.values()):
            return "fail"
        if all(s["passed_at"] for s in sides.values()):
            return "pass"
        return None

    def windows_decided(self) -> bool:
        """Whether the window rules need no more windows: one rejected, or all of them passed."""
        sides = self.sides()
        windows = [s for s in sides.values() if s["unit"] == "windows"]
        return any(s["rejected_at"] for s in windows) or all(s["passed_at"] for s in windows)

    def to_json(self) -> dict:
        sides = self.sides()
        return {
            "method": "testing by betting (Waudby-Smith & Ramdas 2024), aGRAPA bets, Ville's inequality",
            "alpha": self.alpha,
            "bound_factor": BOUND_FACTOR,
            "windows": self.count("windows"),
            "items": self.count("items"),
            "verdict": self.verdict(sides),
            "rules": sides,
        }


def _evalue(log_k: torch.Tensor) -> float:
    """The capital after the last observation (1: nothing observed)."""
    return math.exp(min(log_k[-1].item(), 700.0)) if log_k.numel() else 1.0
