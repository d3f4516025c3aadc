"""`optkit eval --plan` and the plan in every report: what an eval set can resolve (gate/power.py)."""

import math

import torch

from optkit.gate.decision import decide
from optkit.gate.intervals import bootstrap_windows
from optkit.gate.metrics import window_metrics
from optkit.gate.power import plan, spreads
from optkit.gate.thresholds import Thresholds
from tests.gate.test_intervals import synthetic_windows


def test_the_detectable_margin_shrinks_as_one_over_root_n_and_the_units_needed_meet_it():
    pilot = synthetic_windows(16, torch.Generator().manual_seed(0))
    spread = spreads(pilot)
    small = plan(spread, Thresholds(max_kld=0.02), eval_windows=100)["metrics"]["kld_mean"]
    large = plan(spread, Thresholds(max_kld=0.02), eval_windows=400)["metrics"]["kld_mean"]
    assert math.isclose(small["margin_to_pass"], 2 * large["margin_to_pass"], rel_tol=1e-9)
    assert small["margin_to_reject"] == small["margin_to_pass"]  # one threshold: rejects at α as well
    two = plan(spread, Thresholds(max_kld=0.02, min_top1=50), eval_windows=100)["metrics"]["kld_mean"]
    assert two["margin_to_reject"] > two["margin_to_pass"]  # Bonferroni: each rejects at α/2
    needed = small["units_for_this_artifact"]
    at_needed = plan(spread, Thresholds(max_kld=0.02), eval_windows=needed)["metrics"]["kld_mean"]
    gap = 0.02 - small["estimate"]
    assert at_needed["margin_to_pass"] <= gap < small["margin_to_pass"] * math.sqrt(100 / (needed - 1))


def test_an_eval_set_too_small_for_its_threshold_is_warned_about():
    spread = spreads(synthetic_windows(8, torch.Generator().manual_seed(1)))
    tight = plan(spread, Thresholds(max_kld=1e-4), eval_windows=50)
    assert tight["warnings"] and "max_kld" in tight["warnings"][0] and "too small" in tight["warnings"][0]
    assert tight["metrics"]["kld_mean"]["units_for_threshold"] > 50
    assert plan(spread, Thresholds(max_kld=0.5), eval_windows=50)["warnings"] == []
    assert plan(spread, Thresholds(), eval_windows=50)["metrics"] == {}


def test_the_plan_predicts_how_often_confident_passes_an_artifact_at_its_margin():
    """An artifact whose true KLD is margin_to_pass under the threshold passes ~80% of the time
    (the plan's power), on windows like the pilot's."""
    generator = torch.Generator().manual_seed(2)
    true_kld = 0.01 * math.exp(0.3**2 / 2)
    n = 48
    population = synthetic_windows(4000, generator, skew=0.3)
    margin = plan(spreads(population), Thresholds(max_kld=1.0), eval_windows=n)["metrics"]["kld_mean"]["margin_to_pass"]
    thresholds = Thresholds(max_kld=true_kld + margin)
    repeats, passes = 400, 0
    for seed in range(repeats):
        windows = synthetic_windows(n, generator, skew=0.3)
        bounds = bootstrap_windows(windows, resamples=1000, seed=seed)
        passes += decide(window_metrics(windows), thresholds, rule="confident", bounds=bounds).verdict == "pass"
    # ~0.74: on right-skewed windows the bootstrap-t bound lies a little further out than the normal one
    assert 0.65 <= passes / repeats <= 0.9, passes
