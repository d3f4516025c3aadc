"""The sequential gate's bets: valid when read after every window, fast far from a threshold."""

import math

import torch

from optkit.gate.metrics import WindowStats
from optkit.gate.sequential import (
    BOUND_FACTOR,
    MIN_PASS_WINDOWS,
    SequentialGate,
    first_crossing,
    log_capital,
    rules_for,
)
from optkit.gate.thresholds import Thresholds

RUNS, LENGTH, ALPHA = 4000, 200, 0.05


def _kld_like(mean: float, runs: int = RUNS, length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    """Per-window mean KLDs spread like a real artifact's (coefficient of variation ~0.29)."""
    gamma = torch.distributions.Gamma(torch.tensor(12.0, dtype=torch.float64), torch.tensor(12.0 / mean))
    torch.manual_seed(seed)
    return gamma.sample((runs, length))


def _at_most_alpha(rate: float, runs: int = RUNS, alpha: float = ALPHA) -> bool:
    return rate <= alpha + 2 * math.sqrt(alpha * (1 - alpha) / runs)


def test_at_the_threshold_neither_side_errs_more_than_alpha_looked_at_after_every_window():
    tau = 0.01
    x = _kld_like(tau)
    passed = first_crossing(tau - x, (BOUND_FACTOR - 1) * tau, ALPHA)  # any window, from the first
    rejected = first_crossing(x - tau, tau, ALPHA)
    assert _at_most_alpha((passed > 0).double().mean().item())
    assert _at_most_alpha((rejected > 0).double().mean().item())


def test_looking_after_every_window_at_a_fixed_sample_z_test_would_err_far_more_often():
    """Why the bets: the same data, read after every window by a one-sided z-test at α."""
    tau = 0.01
    x = _kld_like(tau)
    t = torch.arange(1, LENGTH + 1)
    mean = x.cumsum(-1) / t
    sd = ((x.square().cumsum(-1) / t - mean.square()).clamp(min=1e-30) * t / (t - 1).clamp(min=1)).sqrt()
    z = (tau - mean) / (sd / t.sqrt())
    peeking = (z[:, 9:] > 1.645).any(-1).double().mean().item()
    assert peeking > 3 * ALPHA


def test_far_from_the_threshold_it_stops_within_tens_of_windows():
    tau = 0.01
    inside, outside = _kld_like(0.5 * tau, seed=1), _kld_like(2 * tau, seed=2)
    passed = first_crossing(tau - inside, (BOUND_FACTOR - 1) * tau, ALPHA, MIN_PASS_WINDOWS)
    rejected = first_crossing(outside - tau, tau, ALPHA)
    assert (passed > 0).all() and (rejected > 0).all()
    assert passed.double().mean() < 40 and rejected.double().mean() < 12


def test_it_never_passes_before_the_tenth_window():
    """Top-1 100% against 50% would pass at the sixth window; a KLD of 0 takes 15 (the bet's cap)."""
    sides = _gate(Thresholds(max_kld=0.01, min_top1=50), kld=[0.0] * 30).sides()
    assert sides["min_top1"]["passed_at"] == MIN_PASS_WINDOWS
    assert MIN_PASS_WINDOWS < sides["max_kld"]["passed_at"] <= 15


def test_a_window_beyond_the_assumed_bound_ends_the_pass_side():
    tau = 0.01
    x = torch.full((1, 40), 0.2 * tau)
    x[0, 3] = BOUND_FACTOR * tau * 1.01  # one window past 4τ: the bound is refuted
    _, held = log_capital(tau - x, (BOUND_FACTOR - 1) * tau)
    assert held[0, :3].all() and not held[0, 3:].any()
    assert first_crossing(tau - x, (BOUND_FACTOR - 1) * tau, ALPHA).item() == 0
    x[0, 3] = BOUND_FACTOR * tau  # at the bound: fine
    assert first_crossing(tau - x, (BOUND_FACTOR - 1) * tau, ALPHA).item() > 0


def _windows(kld: list[float], top1: list[float] | None = None, nll_diff: list[float] | None = None) -> WindowStats:
    n = len(kld)
    tokens = torch.full((n,), 100.0, dtype=torch.float64)
    top1 = torch.tensor(top1 if top1 is not None else [1.0] * n, dtype=torch.float64)
    diff = torch.tensor(nll_diff if nll_diff is not None else [0.0] * n, dtype=torch.float64)
    base = torch.full((n,), 300.0, dtype=torch.float64)
    return WindowStats(tokens, base, base + 100 * diff, 100 * torch.tensor(kld, dtype=torch.float64), 100 * top1)


def _gate(thresholds: Thresholds, alpha: float = ALPHA, **columns) -> SequentialGate:
    gate = SequentialGate(rules_for(thresholds), alpha)
    gate.add_windows(_windows(**columns))
    return gate


def test_the_gate_passes_only_when_every_threshold_has_passed():
    good_kld, poor_top1 = [0.001] * 60, [0.9] * 60  # top-1 90% against a 90% threshold: undecided
    gate = _gate(Thresholds(max_kld=0.01, min_top1=90), kld=good_kld, top1=poor_top1)
    sides = gate.sides()
    assert sides["max_kld"]["passed_at"] and not sides["min_top1"]["passed_at"]
    assert gate.verdict() is None and not gate.windows_decided()
    gate = _gate(Thresholds(max_kld=0.01, min_top1=80), kld=good_kld, top1=poor_top1)
    assert gate.verdict() == "pass" and gate.windows_decided()


def test_one_threshold_crossed_fails_the_gate_at_alpha_over_the_number_of_thresholds():
    kld = [0.011, 0.016] * 30  # mean 0.0135 against 0.01
    one = _gate(Thresholds(max_kld=0.01), kld=kld).sides()["max_kld"]["rejected_at"]
    three = _gate(Thresholds(max_kld=0.01, min_top1=50, max_ppl_increase=50), kld=kld).sides()
    assert one and three["max_kld"]["rejected_at"] > one  # needs e-value 3/α, not 1/α
    assert _gate(Thresholds(max_kld=0.01, min_top1=50), kld=kld).verdict() == "fail"
    assert _gate(Thresholds(max_kld=0.01), kld=kld, alpha=ALPHA).sides()["max_kld"]["reject_evalue"] >= 1 / ALPHA


def test_the_perplexity_bound_comes_from_pilot_windows_the_bets_skip():
    generator = torch.Generator().manual_seed(0)
    diff = (0.002 + 0.006 * torch.randn(80, generator=generator, dtype=torch.float64)).tolist()
    gate = _gate(Thresholds(max_ppl_increase=100 * math.expm1(0.01)), kld=[0.0] * 80, nll_diff=diff)
    side = gate.sides()["max_ppl_increase"]
    low, high = side["bounds"]
    assert high - 0.01 == 0.01 - low > 0
    assert side["passed_at"] > 10 and side["bound_held"]
    assert _gate(Thresholds(max_ppl_increase=1.0), kld=[0.0] * 5, nll_diff=diff[:5]).sides()["max_ppl_increase"][
        "bounds"
    ] == [None, None]


def test_task_recovery_is_tested_per_question_paired_with_the_base():
    gate = SequentialGate(rules_for(Thresholds(min_recovery=0.9)), ALPHA)
    base = torch.ones(200, dtype=torch.bool)
    gate.add_items(base, torch.rand(200, generator=torch.Generator().manual_seed(0)) < 0.99)
    assert gate.verdict() == "pass" and gate.count("items") == 200
    assert gate.sides()["min_recovery"]["passed_at"] >= 30  # never before 30 questions
    gate = SequentialGate(rules_for(Thresholds(min_recovery=0.9)), ALPHA)
    gate.add_items(base, torch.rand(200, generator=torch.Generator().manual_seed(0)) < 0.7)
    assert gate.verdict() == "fail"
