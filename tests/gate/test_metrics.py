import math

import torch

from optkit.gate.metrics import TokenStats, summarize
from optkit.gate.thresholds import Thresholds, check


def test_identical_models_have_zero_divergence_and_full_agreement():
    logits = torch.randn(2, 10, 50)
    tokens = torch.randint(0, 50, (2, 10))
    stats = TokenStats()
    stats.add(logits, logits.clone(), tokens)
    m = summarize(stats)
    assert m["num_tokens"] == 2 * 9
    assert m["kld_max"] < 1e-6 and m["top1_pct"] == 100.0 and abs(m["ppl_increase_pct"]) < 1e-9


def test_kld_and_perplexity_match_hand_computation():
    # one predicted token, vocabulary of two: p_base = (0.5, 0.5), p_art = (0.8, 0.2)
    base = torch.log(torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]))
    art = torch.log(torch.tensor([[[0.8, 0.2], [0.5, 0.5]]]))
    tokens = torch.tensor([[0, 1]])  # the target of position 0 is token 1
    stats = TokenStats()
    stats.add(base, art, tokens)
    m = summarize(stats)
    expected_kld = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert math.isclose(m["kld_mean"], expected_kld, rel_tol=1e-5)
    assert math.isclose(m["ppl_base"], 2.0, rel_tol=1e-5)
    assert math.isclose(m["ppl_artifact"], 5.0, rel_tol=1e-5)
    assert math.isclose(m["ppl_increase_pct"], 150.0, rel_tol=1e-5)
    assert m["top1_pct"] == 100.0  # argmax of a tie is the first index: both pick token 0


def test_percentiles_are_ordered():
    stats = TokenStats()
    for _ in range(3):
        stats.add(torch.randn(4, 16, 30), torch.randn(4, 16, 30), torch.randint(0, 30, (4, 16)))
    m = summarize(stats)
    assert 0 <= m["kld_median"] <= m["kld_p95"] <= m["kld_p99"] <= m["kld_max"]
    assert 0 <= m["top1_pct"] < 100


def test_thresholds_pass_and_fail():
    metrics = {"ppl_increase_pct": 0.4, "kld_mean": 0.006, "top1_pct": 93.0}
    checks = check(metrics, Thresholds(max_ppl_increase=0.5, max_kld=0.005, min_top1=95))
    assert [(c.name, c.passed) for c in checks] == [("max_ppl_increase", True), ("max_kld", False), ("min_top1", False)]
    assert check(metrics, Thresholds()) == []


def test_nan_metric_fails_its_threshold():
    checks = check(
        {"ppl_increase_pct": float("nan"), "kld_mean": 0.0, "top1_pct": 100.0}, Thresholds(max_ppl_increase=100)
    )
    assert not checks[0].passed


def test_window_sums_give_the_token_level_metrics_for_any_subset_of_windows():
    from optkit.gate.metrics import WindowStats, window_metrics

    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (5, 9))
    base, artifact = torch.randn(5, 9, 50), torch.randn(5, 9, 50)
    stats = TokenStats()
    for rows in (slice(0, 3), slice(3, 5)):  # two batches
        stats.add(base[rows], artifact[rows], tokens[rows])
    windows = WindowStats.of(stats)
    assert len(windows) == 5
    # a subset of windows (with a repeat, as a bootstrap draws) scores as those windows alone
    subset = [4, 0, 0]
    alone = TokenStats()
    alone.add(base[subset], artifact[subset], tokens[subset])
    expected = summarize(alone)
    for key, value in window_metrics(windows.select(subset)).items():
        assert abs(value - expected[key]) < 1e-6 * max(1.0, abs(expected[key])), key
