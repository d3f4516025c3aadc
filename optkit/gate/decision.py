"""The gate's verdict from its thresholds and what the eval set can say about them.

`point` (the default): pass when every metric's estimate is inside its threshold, else fail.

`confident`: a test per threshold. For `max_kld = L` the claim to prove is "mean KLD ≤ L":
- pass when every threshold's pessimistic one-sided bound at level α is inside it (the upper bound
  U_α for a `max_*`, the lower bound for a `min_*`). This is an intersection-union test (Berger
  1982): the artifact passes only if each of the m one-sided tests passes, and the chance of
  passing an artifact that breaks some threshold is at most α with no multiplicity correction;
- reject (exit 1) when some threshold's optimistic bound is outside it at level α/m (Bonferroni
  across the m thresholds: the chance of rejecting an artifact that meets them all is ≤ α);
- otherwise inconclusive (exit 4), with the number of windows that would decide it if the estimate holds.
Below MIN_WINDOWS windows (MIN_ITEMS task questions) `confident` neither passes nor rejects: a
bootstrap over so few units understates its own spread, on either side (docs/results.md).

No threshold at all: the verdict is `report_only` (exit 0) under either rule; the gate was asked
nothing, so it says nothing passed.

The windows needed: a bound's distance from the estimate, d, shrinks as 1/√n, so if the estimate
stays where it is the bound reaches the threshold L at n' = n (d / |L − θ̂|)²: the pass side when
every estimate is inside (the largest n' over the undecided thresholds), the reject side when some
estimate is outside (the smallest n' over those). At n' the estimate, if it holds, just decides: a
fresh estimate is as likely above as below it, so n' is where the odds turn, not a guarantee; the
plan (gate/power.py, units_for_this_artifact) gives the windows that decide with 80% power.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from optkit.gate.thresholds import Check, Thresholds, check

Verdict = Literal["pass", "fail", "inconclusive", "report_only"]
Rule = Literal["point", "confident"]
EXIT_CODES: dict[str, int] = {"pass": 0, "report_only": 0, "fail": 1, "inconclusive": 4}
MIN_WINDOWS = 10
MIN_ITEMS = 30
TASK_METRICS = ("task_acc_artifact", "task_recovery", "task_acc_base")


class Bounds(Protocol):
    """One-sided bounds per metric (gate/intervals.Bootstrap; a confidence sequence fits too)."""

    def estimate(self, metric: str) -> float: ...
    def upper(self, metric: str, alpha: float) -> float: ...
    def lower(self, metric: str, alpha: float) -> float: ...
    def units(self, metric: str) -> int: ...
    def __contains__(self, metric: str) -> bool: ...


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    rule: Rule
    alpha: float
    checks: list[Check] = field(default_factory=list)
    windows_needed: int | None = None  # inconclusive: windows that decide it if the estimates hold
    items_needed: int | None = None  # inconclusive on a task metric: questions that would
    reason: str = ""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self, windows: int | None = None, items: int | None = None) -> dict:
        extra = {}
        if self.windows_needed is not None and windows is not None:
            extra["extra_windows"] = max(self.windows_needed - windows, 0)
        if self.items_needed is not None and items is not None:
            extra["extra_items"] = max(self.items_needed - items, 0)
        return {
            "rule": self.rule,
            "alpha": self.alpha,
            "verdict": self.verdict,
            "windows_needed": self.windows_needed,
            "items_needed": self.items_needed,
            **extra,
            "reason": self.reason,
        }


def minimum_units(metric: str) -> int:
    return MIN_ITEMS if metric in TASK_METRICS else MIN_WINDOWS


def decide(
    metrics: dict[str, float],
    thresholds: Thresholds,
    *,
    rule: Rule = "point",
    bounds: Bounds | None = None,
    alpha: float = 0.05,
) -> Decision:
    """The verdict on `metrics` against `thresholds` (module doc). `bounds` is needed for `confident`."""
    checks = check(metrics, thresholds)
    if not checks:
        return Decision("report_only", rule, alpha, [], reason="no threshold is set: nothing was asked")
    if rule == "point":
        verdict = "pass" if all(c.passed for c in checks) else "fail"
        crossed = [c.name for c in checks if not c.passed]
        return Decision(verdict, rule, alpha, checks, reason=f"crossed: {', '.join(crossed)}" if crossed else "")
    if bounds is None:
        raise ValueError("the confident rule needs bounds")
    checks = [_confident_check(c, bounds, alpha, len(checks)) for c in checks]
    if any(c.state == "crossed" for c in checks):
        crossed = ", ".join(c.name for c in checks if c.state == "crossed")
        return Decision("fail", rule, alpha, checks, reason=f"outside at {alpha / len(checks):.4g} each: {crossed}")
    if all(c.state == "ok" for c in checks):
        return Decision("pass", rule, alpha, checks)
    windows, items = _units_needed(checks, bounds, alpha)
    unsure = [c for c in checks if c.state == "unsure"]
    few = [c.name for c in unsure if bounds.units(c.metric) < minimum_units(c.metric)]
    reason = "the bounds decide neither way on " + ", ".join(c.name for c in unsure)
    if few:
        reason += f" (too few units to decide: at least {MIN_WINDOWS} windows, {MIN_ITEMS} task questions)"
    return Decision("inconclusive", rule, alpha, checks, windows, items, reason)


def _confident_check(c: Check, bounds: Bounds, alpha: float, m: int) -> Check:
    if math.isnan(c.value) or c.metric not in bounds:
        return replace(c, passed=False, state="crossed")
    if c.upper:  # metric ≤ limit
        pessimistic, optimistic = bounds.upper(c.metric, alpha), bounds.lower(c.metric, alpha / m)
        inside, outside = pessimistic <= c.limit, optimistic > c.limit
    else:
        pessimistic, optimistic = bounds.lower(c.metric, alpha), bounds.upper(c.metric, alpha / m)
        inside, outside = pessimistic >= c.limit, optimistic < c.limit
    enough = bounds.units(c.metric) >= minimum_units(c.metric)
    if outside and enough:
        return replace(c, passed=False, state="crossed", bound=optimistic)
    if inside and enough:
        return replace(c, passed=True, state="ok", bound=pessimistic)
    return replace(c, passed=False, state="unsure", bound=pessimistic)


def units_to_reach(n: int, distance: float, gap: float, minimum: int) -> int | None:
    """Units at which a bound `distance` from its estimate (shrinking as 1/√n) comes within `gap`
    of it; None when the estimate sits on the threshold (no number of units decides it)."""
    if gap <= 0 or not math.isfinite(distance):
        return None
    return max(math.ceil(n * (distance / gap) ** 2), n + 1, minimum)


def _units_needed(checks: list[Check], bounds: Bounds, alpha: float) -> tuple[int | None, int | None]:
    """(windows, task questions) that decide the undecided checks if the estimates hold (module doc)."""
    m = len(checks)
    needed: dict[bool, list[int | None]] = {True: [], False: []}  # keyed by "is a task metric"
    rejecting: dict[bool, list[int | None]] = {True: [], False: []}
    for c in checks:
        if c.state != "unsure":
            continue
        estimate, n = bounds.estimate(c.metric), bounds.units(c.metric)
        outside = estimate > c.limit if c.upper else estimate < c.limit
        if outside:  # the reject side: the optimistic bound, at α/m, must cross the threshold
            bound = bounds.lower(c.metric, alpha / m) if c.upper else bounds.upper(c.metric, alpha / m)
        else:
            bound = bounds.upper(c.metric, alpha) if c.upper else bounds.lower(c.metric, alpha)
        units = units_to_reach(n, abs(bound - estimate), abs(c.limit - estimate), minimum_units(c.metric))
        (rejecting if outside else needed)[c.metric in TASK_METRICS].append(units)

    def pick(task: bool) -> int | None:
        if rejecting[False] or rejecting[True]:  # one threshold crossed suffices: the cheapest to prove
            known = [u for u in rejecting[task] if u is not None]
            return min(known) if known else None
        if needed[task]:  # every threshold must be proven: the dearest
            return None if None in needed[task] else max(needed[task])
        return None

    return pick(False), pick(True)
