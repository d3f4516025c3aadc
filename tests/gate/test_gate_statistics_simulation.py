"""The gate's statistics, checked by simulation on a real artifact's per-window values: with the
threshold at the artifact's own full-set value, `confident` and `--sequential` pass at most α of
the time; the intervals cover the full-set value at their nominal rate; far from a threshold
`--sequential` decides on a fraction of the windows. (bench/gate_statistics.py runs the same
checks on `small` with more draws; its figures are in docs/results.md.)"""

import math

import pytest
import torch

from optkit.gate.decision import decide
from optkit.gate.intervals import bootstrap_items, bootstrap_windows
from optkit.gate.metrics import window_metrics
from optkit.gate.sequential import SequentialGate, rules_for
from optkit.gate.thresholds import Thresholds

RUNS, ALPHA = 1000, 0.05


def _at_most(rate: float, nominal: float) -> bool:
    return rate <= nominal + 2 * math.sqrt(nominal * (1 - nominal) / RUNS)


@pytest.fixture(scope="module")
def population(tmp_path_factory, draft_dir):
    """RTN w4 of `draft`, scored on 160 windows of 64 tokens: the population the draws come from."""
    from optkit.gate.evaluate import evaluate
    from optkit.gate.options import GateOptions
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("artifacts") / "draft-w4"
    quantize_model(draft_dir, out, QuantizeOptions())
    return evaluate(out, draft_dir, GateOptions(seq_len=64, max_windows=160)).windows


def _draws(n: int, size: int, seed: int) -> torch.Tensor:
    return torch.randint(n, (RUNS, size), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("size", [16, 32])
def test_confident_passes_at_most_alpha_at_the_threshold_while_point_flips(population, size):
    tau = window_metrics(population)["kld_mean"]
    passed = flipped = 0
    for run, index in enumerate(_draws(len(population), size, seed=size)):
        subset = population.select(index)
        metrics = window_metrics(subset)
        bounds = bootstrap_windows(subset, resamples=400, seed=run)
        passed += decide(metrics, Thresholds(max_kld=tau), rule="confident", bounds=bounds).verdict == "pass"
        flipped += metrics["kld_mean"] > tau  # the full set itself passes: its value is the threshold
    assert _at_most(passed / RUNS, ALPHA)
    assert flipped / RUNS > 0.3  # the point rule is a coin toss here


def test_the_intervals_cover_the_full_set_value_at_their_nominal_rate(population):
    truth = window_metrics(population)
    covered = dict.fromkeys(truth, 0)
    for run, index in enumerate(_draws(len(population), 32, seed=1)):
        bounds = bootstrap_windows(population.select(index), resamples=400, seed=run)
        for metric, value in truth.items():
            low, high = bounds.interval(metric, 0.95)
            covered[metric] += low <= value <= high
    noise = 2 * math.sqrt(0.95 * 0.05 / RUNS) + 0.01  # binomial noise, and 400 resamples' own
    for metric, count in covered.items():
        assert abs(count / RUNS - 0.95) <= noise, (metric, count / RUNS)


def test_task_accuracy_intervals_cover_at_their_nominal_rate():
    """Questions a real model gets right 60% of the time, the artifact agreeing on 90% of them."""
    generator = torch.Generator().manual_seed(0)
    base = torch.rand(200, generator=generator) < 0.6
    artifact = torch.where(torch.rand(200, generator=generator) < 0.9, base, ~base)
    truth = artifact.double().mean().item()
    covered = 0
    for run, index in enumerate(_draws(200, 120, seed=2)):
        low, high = bootstrap_items(base[index], artifact[index], resamples=400, seed=run).interval(
            "task_acc_artifact", 0.95
        )
        covered += low <= truth <= high
    assert abs(covered / RUNS - 0.95) <= 2 * math.sqrt(0.95 * 0.05 / RUNS) + 0.01


def _sequential(population, thresholds: Thresholds, seed: int) -> tuple[list[str | None], list[int]]:
    """Each run: the windows drawn i.i.d. from the population, read after every one; its verdict
    and the windows it took (all of them if it never decided)."""
    verdicts, used = [], []
    n = len(population)
    for index in _draws(n, n, seed=seed):
        gate = SequentialGate(rules_for(thresholds), ALPHA)
        gate.add_windows(population.select(index))
        sides = gate.sides().values()
        passed = max(s["passed_at"] if s["passed_at"] else n + 1 for s in sides)
        failed = min(s["rejected_at"] if s["rejected_at"] else n + 1 for s in sides)
        verdicts.append("pass" if passed < failed and passed <= n else "fail" if failed <= n else None)
        used.append(min(passed, failed, n))
    return verdicts, used


def test_sequential_keeps_its_error_rate_at_the_threshold(population):
    truth = window_metrics(population)
    at = Thresholds(max_kld=truth["kld_mean"], min_top1=truth["top1_pct"])
    verdicts, _ = _sequential(population, at, seed=3)
    assert _at_most(verdicts.count("pass") / RUNS, ALPHA) and _at_most(verdicts.count("fail") / RUNS, ALPHA)


@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_sequential_decides_on_at_most_half_the_windows_at_half_and_twice_the_threshold(population, scale):
    tau = window_metrics(population)["kld_mean"] / scale  # the artifact sits at `scale` x the threshold
    verdicts, used = _sequential(population, Thresholds(max_kld=tau), seed=4)
    assert verdicts.count("pass" if scale < 1 else "fail") / RUNS > 0.99
    assert sum(used) / RUNS <= len(population) / 2
