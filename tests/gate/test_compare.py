"""Comparing two artifacts on the same windows: paired intervals, p-values, McNemar's exact test."""

import math

import torch

from optkit.gate.compare import compare_items, compare_windows, comparison_table, mcnemar_exact, to_json
from optkit.gate.metrics import WindowStats


def _pair(n: int, gap: float, noise: float, seed: int) -> tuple[WindowStats, WindowStats]:
    """Two artifacts whose per-window KLD shares each window's difficulty (hard windows are hard
    for both) and differs by `gap` on average plus independent noise."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((n,), 255.0, dtype=torch.float64)
    difficulty = torch.distributions.Gamma(4.0, 4.0 / 0.01).sample((n,)).double()
    kld_a = difficulty + noise * torch.randn(n, generator=g, dtype=torch.float64)
    kld_b = difficulty + gap + noise * torch.randn(n, generator=g, dtype=torch.float64)
    nll_base = 3.0 * tokens + 20 * torch.randn(n, generator=g, dtype=torch.float64)
    top1 = 0.9 * tokens

    def stats(kld):
        return WindowStats(tokens, nll_base, nll_base + kld * tokens, kld.clamp(min=0) * tokens, top1)

    return stats(kld_a), stats(kld_b)


def test_mcnemar_exact_is_the_binomial_tail_of_the_discordant_questions():
    a = torch.tensor([1] * 10 + [0] * 2 + [1] * 30 + [0] * 5, dtype=torch.bool)  # 10 only A, 2 only B
    b = torch.tensor([0] * 10 + [1] * 2 + [1] * 30 + [0] * 5, dtype=torch.bool)
    assert math.isclose(mcnemar_exact(a, b), 2 * (1 + 12 + 66) / 2**12)
    assert mcnemar_exact(a, b) == mcnemar_exact(b, a)
    assert mcnemar_exact(a, a) == 1.0


def test_a_paired_difference_resolves_what_two_separate_intervals_cannot():
    torch.manual_seed(0)
    a, b = _pair(32, gap=0.001, noise=0.0003, seed=0)
    kld = {d.metric: d for d in compare_windows(a, b)}["kld_mean"]
    assert kld.high < 0 and kld.p_value < 0.01 and kld.better == "A"
    assert math.isclose(kld.difference, kld.a - kld.b, rel_tol=1e-9)
    # unpaired: each artifact's own mean ± 2 se overlaps the other's (the windows' difficulty dominates)
    per_a, per_b = a.kld / a.tokens, b.kld / b.tokens
    se = max(per_a.std(), per_b.std()).item() / math.sqrt(32)
    assert abs(per_a.mean() - per_b.mean()).item() < 4 * se
    reverse = {d.metric: d for d in compare_windows(b, a)}["kld_mean"]
    assert reverse.better == "B" and reverse.low > 0


def test_the_p_value_is_below_alpha_exactly_when_the_interval_leaves_zero_out():
    for seed in range(12):
        a, b = _pair(24, gap=0.0002 * (seed % 4), noise=0.0004, seed=seed)
        for d in compare_windows(a, b, confidence=0.9, resamples=800, seed=seed):
            excluded = not (d.low <= 0 <= d.high)
            assert excluded == (d.p_value < 0.1) or abs(d.p_value - 0.1) < 0.01, (seed, d)


def test_two_equally_good_artifacts_are_told_apart_at_most_at_the_nominal_rate():
    runs, rejected = 200, 0
    for seed in range(runs):
        a, b = _pair(24, gap=0.0, noise=0.0005, seed=1000 + seed)
        kld = {d.metric: d for d in compare_windows(a, b, resamples=400, seed=seed)}["kld_mean"]
        rejected += kld.p_value < 0.05
    assert rejected / runs <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / runs)


def test_task_questions_are_compared_by_mcnemar_with_an_interval_in_points():
    g = torch.Generator().manual_seed(0)
    b = torch.rand(400, generator=g) < 0.6
    a = b | (torch.rand(400, generator=g) < 0.15)  # A gets right all B does, and more
    d = compare_items(a, b)
    assert d.test == "McNemar exact" and d.p_value < 1e-6 and d.better == "A"
    assert d.low > 0 and math.isclose(d.difference, d.a - d.b, rel_tol=1e-9)
    assert compare_items(b, b).p_value == 1.0 and compare_items(b, b).better == ""


def test_the_table_names_each_metric_its_interval_test_and_the_better_artifact():
    from rich.console import Console

    a, b = _pair(32, gap=0.001, noise=0.0003, seed=0)
    comparison = to_json(compare_windows(a, b) + [compare_items(torch.ones(40), torch.zeros(40))], 0.95)
    console = Console(width=200, record=True)
    console.print(comparison_table(comparison, "gptq", "rtn"))
    text = console.export_text()
    assert "A = gptq, B = rtn" in text and "McNemar exact" in text and "paired bootstrap-t" in text
    kld_row = next(line for line in text.splitlines() if "KL divergence" in line)
    assert kld_row.rstrip(" │").endswith("A")
