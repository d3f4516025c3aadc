"""The gate's bootstrap intervals: they cover the true value at about their nominal rate, they
are paired, and a seed makes them reproducible."""

import math

import torch

from optkit.gate.intervals import bootstrap_items, bootstrap_windows
from optkit.gate.metrics import WindowStats, window_metrics


def synthetic_windows(n: int, generator: torch.Generator, *, skew: float = 0.5, tokens: int = 255) -> WindowStats:
    """n windows whose mean KLD per token is lognormal(log 0.01, skew) (right-skewed, as real KLD
    is), with base NLL varying a lot between windows and the artifact's a little above it."""
    t = torch.full((n,), float(tokens), dtype=torch.float64)
    kld = torch.exp(torch.randn(n, generator=generator, dtype=torch.float64) * skew) * 0.01 * t
    nll_base = t * (2.8 + 0.5 * torch.randn(n, generator=generator, dtype=torch.float64))
    nll_artifact = nll_base + 2 * kld
    top1 = t * (0.9 + 0.02 * torch.randn(n, generator=generator, dtype=torch.float64))
    return WindowStats(t, nll_base, nll_artifact, kld, top1)


def test_intervals_cover_the_true_mean_kld_at_about_the_nominal_rate():
    generator = torch.Generator().manual_seed(0)
    true_kld = 0.01 * math.exp(0.5**2 / 2)
    repeats, covered, upper_holds = 400, 0, 0
    for seed in range(repeats):
        bounds = bootstrap_windows(synthetic_windows(40, generator), resamples=1000, seed=seed)
        low, high = bounds.interval("kld_mean", 0.95)
        covered += low <= true_kld <= high
        upper_holds += true_kld <= bounds.upper("kld_mean", 0.05)
    # 95% nominal; binomial noise over 400 repeats is ±2.2% (2 s.e.); a plain normal interval on
    # such skewed windows covers ~91%
    assert 0.91 <= covered / repeats <= 0.985, covered
    assert 0.91 <= upper_holds / repeats <= 0.985, upper_holds


def test_the_task_interval_covers_the_true_accuracy_at_about_the_nominal_rate():
    generator = torch.Generator().manual_seed(1)
    repeats, covered = 400, 0
    for seed in range(repeats):
        base = torch.rand(100, generator=generator) < 0.6
        artifact = torch.where(torch.rand(100, generator=generator) < 0.1, ~base, base)  # 10% flipped
        low, high = bootstrap_items(base, artifact, resamples=1000, seed=seed).interval("task_acc_artifact")
        covered += low <= 0.6 * 0.9 + 0.4 * 0.1 <= high
    assert 0.91 <= covered / repeats <= 0.985, covered


def test_the_estimate_is_the_metric_of_every_window_and_the_interval_brackets_it():
    windows = synthetic_windows(30, torch.Generator().manual_seed(2))
    bounds = bootstrap_windows(windows)
    for metric, value in window_metrics(windows).items():
        low, high = bounds.interval(metric)
        assert math.isclose(bounds.estimate(metric), value, rel_tol=1e-9), metric
        assert low < value < high and bounds.units(metric) == 30, metric
        assert bounds.lower(metric, 0.05) >= low and bounds.upper(metric, 0.05) <= high  # one side at 5% is inside


def test_the_perplexity_interval_is_paired():
    """Windows differ a lot in difficulty, the artifact's NLL moves with the base's: the paired
    interval of Δppl sees only the difference, far narrower than the spread of either perplexity."""
    windows = synthetic_windows(30, torch.Generator().manual_seed(3))
    low, high = bootstrap_windows(windows).interval("ppl_increase_pct")
    # an unpaired resample would move the base's ppl by ~5% (NLL s.d. 0.5 nats over 30 windows)
    assert high - low < 1.0, (low, high)


def test_the_same_seed_gives_the_same_interval_and_another_seed_a_different_one():
    windows = synthetic_windows(20, torch.Generator().manual_seed(4))
    first = bootstrap_windows(windows, seed=7).to_json()
    assert bootstrap_windows(windows, seed=7).to_json() == first
    assert bootstrap_windows(windows, seed=8).to_json() != first


def test_an_artifact_equal_to_its_base_has_a_zero_width_interval():
    t = torch.full((12,), 100.0, dtype=torch.float64)
    nll = torch.rand(12, dtype=torch.float64) * 300
    windows = WindowStats(t, nll, nll.clone(), torch.zeros(12, dtype=torch.float64), t.clone())
    bounds = bootstrap_windows(windows)
    assert bounds.interval("kld_mean") == (0.0, 0.0) and bounds.interval("top1_pct") == (100.0, 100.0)
    assert bounds.interval("ppl_increase_pct") == (0.0, 0.0)


def test_a_task_answered_exactly_as_the_base_answers_still_has_an_interval():
    """No question answered differently: the bootstrap sees no spread, but a disagreement may be
    unseen; the bound is the exact binomial one at zero events (≈ 3/n at 95%)."""
    base = torch.arange(30) % 2 == 0  # 15 of 30 right
    bounds = bootstrap_items(base, base.clone())
    low, _ = bounds.interval("task_recovery", 0.90)
    lost = 30 * (1 - 0.05 ** (1 / 30))  # questions the artifact may lose unseen, at 5%
    assert math.isclose(low, 1 - lost / 15, rel_tol=1e-9) and low < 0.95
    many = torch.arange(400) % 2 == 0
    assert bootstrap_items(many, many.clone()).lower("task_recovery", 0.05) > 0.95
    everything = torch.ones(30, dtype=torch.bool)
    low, high = bootstrap_items(everything, everything.clone()).interval("task_acc_artifact", 0.90)
    assert high == 1.0 and math.isclose(low, 0.05 ** (1 / 30), rel_tol=1e-9)  # Clopper-Pearson at 30 of 30


def test_two_windows_give_wide_bounds_inside_each_metrics_range():
    """Half the resamples of 2 windows repeat one window: t* explodes, and the bounds with it; they
    must stay where the metric can be (KLD ≥ 0, top-1 within 0-100%), not overflow."""
    windows = synthetic_windows(2, torch.Generator().manual_seed(5))
    bounds = bootstrap_windows(windows)
    low, high = bounds.interval("kld_mean")
    assert low == 0.0 and high > 10 * bounds.estimate("kld_mean")
    low, high = bounds.interval("top1_pct")
    assert 0.0 <= low and high <= 100.0
    low, high = bounds.interval("ppl_increase_pct")
    assert low >= -100.0 and high > bounds.estimate("ppl_increase_pct")


def test_a_task_bound_falls_steadily_as_disagreements_grow_and_never_collapses():
    """1-3 differing answers among many: a resample that misses them all has no spread; it must not
    drag the bound to 0 (it once did), nor leave it tighter than with no difference seen."""
    from optkit.gate.intervals import bootstrap_items

    lowers = []
    for flips in range(0, 11):
        base, artifact = torch.ones(1000), torch.ones(1000)
        artifact[:flips] = 0
        bounds = bootstrap_items(base, artifact)
        lowers.append(bounds.lower("task_recovery", 0.05))
        assert bounds.lower("task_recovery", 0.05) <= 1 - flips / 1000 <= bounds.upper("task_recovery", 0.05)
    assert all(a >= b - 5e-4 for a, b in zip(lowers[:-1], lowers[1:], strict=True)), lowers  # resampling noise
    assert lowers[1] > 0.99 and lowers[3] > 0.98
