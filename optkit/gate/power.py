"""How small a regression an eval set resolves, and how many windows a threshold needs. Pure math.

Normal approximation on the ratio estimator (the delta method). A metric is θ̂ = Σy / Σt over n
units (intervals.py: windows, or task questions), mapped by a monotone g; its standard error is
se(θ̂) = σ/√n with σ = √n · se from intervals.ratio_se, and σ_g = g'(θ̂) · σ in the metric's units.
A one-sided test at level α has power 1 − β against a true value δ on the far side of the
threshold when δ ≥ (z_{1−α} + z_{1−β}) σ_g / √N. With N units in the eval set:
- margin_to_pass: how far inside a threshold an artifact must be for `--decision confident` to
  pass it with probability 1 − β (test at α: the pass side, an intersection-union test);
- margin_to_reject: how far outside, for it to be rejected (at α/m, Bonferroni over m thresholds);
- units_for_threshold: the units (windows or questions) N at which margin_to_pass equals the threshold's own distance
  from an artifact identical to its base (KLD 0, Δppl 0, top-1 100 %, recovery 1): below that the
  eval set's noise is larger than the regression the threshold allows, and the report warns;
- units_for_this_artifact: the units that decide an artifact whose true value is the pilot's
  estimate (pass side when it is inside, reject side when outside; None when it is on the line).
σ is the pilot's: the plan is for artifacts whose windows spread like the pilot's (a larger KLD
spreads more), and it ignores the skew the bootstrap-t bounds allow for, so it is a guide to the
eval set's size, not a promise; power 1 − β = 0.8 by default.
"""

import math
from statistics import NormalDist

import torch

from optkit.gate.intervals import ratio_se
from optkit.gate.metrics import WindowStats
from optkit.gate.thresholds import RULES, Thresholds

POWER = 0.8
PERFECT = {"ppl_increase_pct": 0.0, "kld_mean": 0.0, "top1_pct": 100.0, "task_recovery": 1.0}


def _z(p: float) -> float:
    return NormalDist().inv_cdf(p)


def spreads(windows: WindowStats, answers: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """metric -> (estimate, σ per unit in the metric's units, units) for every gated metric."""
    tokens = windows.tokens.double()
    out = {}
    theta, se = ratio_se((windows.nll_artifact - windows.nll_base).double(), tokens)
    n = len(windows)
    out["ppl_increase_pct"] = (100.0 * math.expm1(theta), 100.0 * math.exp(theta) * se * math.sqrt(n), n)
    theta, se = ratio_se(windows.kld.double(), tokens)
    out["kld_mean"] = (theta, se * math.sqrt(n), n)
    theta, se = ratio_se(windows.top1.double(), tokens)
    out["top1_pct"] = (100.0 * theta, 100.0 * se * math.sqrt(n), n)
    if answers is not None:
        base, artifact = (a.double() for a in answers)
        theta, se = ratio_se(artifact, base)
        out["task_recovery"] = (theta, se * math.sqrt(base.numel()), base.numel())
    return out


def units_for(sigma: float, distance: float, z_sum: float) -> int | None:
    """Units at which (z_{1−α} + z_{1−β}) σ / √N equals `distance`."""
    if distance <= 0:
        return None
    return max(math.ceil((z_sum * sigma / distance) ** 2), 1)


def plan(
    spread: dict,
    thresholds: Thresholds,
    *,
    eval_windows: int,
    eval_items: int | None = None,
    alpha: float = 0.05,
    power: float = POWER,
) -> dict:
    """The plan for each threshold that is set (module doc), from `spreads` of a pilot or a run.
    eval_windows / eval_items: the units the configured eval set (and task) holds."""
    limits = {metric: (name, getattr(thresholds, name), upper) for name, (metric, upper) in RULES.items()}
    limits = {m: v for m, v in limits.items() if v[1] is not None and m in spread}
    m = max(len(limits), 1)
    z_pass, z_reject = _z(1 - alpha) + _z(power), _z(1 - alpha / m) + _z(power)
    metrics, warnings = {}, []
    for metric, (name, limit, upper) in limits.items():
        estimate, sigma, pilot = spread[metric]
        total = eval_items if metric.startswith("task_") else eval_windows
        unit = "questions" if metric.startswith("task_") else "windows"
        total = total or pilot
        inside = estimate <= limit if upper else estimate >= limit
        for_threshold = units_for(sigma, abs(limit - PERFECT[metric]), z_pass)
        metrics[metric] = {
            "threshold": name,
            "limit": limit,
            "estimate": estimate,
            "sd_per_unit": sigma,
            "pilot_units": pilot,
            "eval_units": total,
            "margin_to_pass": z_pass * sigma / math.sqrt(total),
            "margin_to_reject": z_reject * sigma / math.sqrt(total),
            "units_for_threshold": for_threshold,
            "units_for_this_artifact": units_for(sigma, abs(limit - estimate), z_pass if inside else z_reject),
            "unit": unit,
        }
        if for_threshold is not None and total < for_threshold:
            warnings.append(
                f"the eval set is too small for {name} {limit:g}: {total} {unit} resolve "
                f"{metrics[metric]['margin_to_pass']:.3g}, more than the threshold allows; "
                f"{for_threshold} {unit} are needed at {1 - alpha:.0%} confidence and {power:.0%} power"
            )
    return {"confidence": 1 - alpha, "power": power, "metrics": metrics, "warnings": warnings}
