"""Gate thresholds and the point comparison of each metric with its threshold (gate/decision.py
turns checks into a verdict). Field names are the recipe keys."""

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class Thresholds(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # finite and in the metric's range: a recipe is someone else's file
    max_ppl_increase: float | None = Field(default=None, gt=-100, allow_inf_nan=False)  # percent
    max_kld: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # mean KL divergence, nats
    min_top1: float | None = Field(default=None, ge=0, le=100, allow_inf_nan=False)  # percent keeping the top token
    min_recovery: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # task accuracy / the base's

    def any_set(self) -> bool:
        return any(getattr(self, name) is not None for name in RULES)


@dataclass(frozen=True)
class Check:
    name: str
    metric: str
    value: float
    limit: float
    passed: bool
    state: str = ""  # "ok" | "crossed" | "unsure" (confident rule: the bounds decide neither way)
    bound: float | None = None  # confident rule: the one-sided bound that decided (or the pessimistic one)

    def __post_init__(self):
        if not self.state:
            object.__setattr__(self, "state", "ok" if self.passed else "crossed")

    @property
    def upper(self) -> bool:
        """True when the metric must stay at or below the limit."""
        return not self.name.startswith("min_")

    @property
    def rule(self) -> str:
        return f"{'≤' if self.upper else '≥'} {self.limit:g}"


# threshold field -> (metric it bounds, True when the metric must stay at or below it)
RULES = {
    "max_ppl_increase": ("ppl_increase_pct", True),
    "max_kld": ("kld_mean", True),
    "min_top1": ("top1_pct", False),
    "min_recovery": ("task_recovery", False),
}


def check(metrics: dict[str, float], thresholds: Thresholds) -> list[Check]:
    """One check per threshold that is set. A NaN metric fails every check it is in."""
    checks = []
    for name, (metric, upper) in RULES.items():
        limit = getattr(thresholds, name)
        if limit is None:
            continue
        value = metrics.get(metric, float("nan"))  # a threshold on a metric not measured fails
        passed = not math.isnan(value) and (value <= limit if upper else value >= limit)
        checks.append(Check(name, metric, value, limit, passed))
    return checks
