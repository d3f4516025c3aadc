"""Gate thresholds and the pass/fail decision. Field names are the recipe keys."""

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class Thresholds(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_ppl_increase: float | None = None  # percent
    max_kld: float | None = None  # mean KL divergence, nats
    min_top1: float | None = None  # percent of tokens with the base's top token
    min_recovery: float | None = None  # task accuracy of the artifact / of the base (needs a task)


@dataclass(frozen=True)
class Check:
    name: str
    metric: str
    value: float
    limit: float
    passed: bool

    @property
    def rule(self) -> str:
        op = "≥" if self.name.startswith("min_") else "≤"
        return f"{op} {self.limit:g}"


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
