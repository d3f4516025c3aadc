"""The online metrics are the gate's, on the positions that predict a request's output tokens."""

import math

import pytest
import torch

from optkit.gate.metrics import TokenStats, summarize
from optkit.routing.online import ShadowScore, crossed, gate_thresholds, score_rows, score_sequence, total


def test_score_rows_is_the_gates_token_stats():
    torch.manual_seed(0)
    full, quant = torch.randn(10, 32), torch.randn(10, 32)
    tokens = torch.randint(0, 32, (10,))
    stats = TokenStats()
    stats.add(full[None], quant[None], tokens[None])  # as optkit eval: positions 0..8 predict tokens 1..9
    expected = summarize(stats)
    score = score_rows(full[:9], quant[:9], tokens[1:])
    metrics = score.metrics()
    assert score.num_tokens == 9
    assert metrics["kld_mean"] == pytest.approx(expected["kld_mean"], rel=1e-6)
    assert metrics["top1_pct"] == pytest.approx(expected["top1_pct"])
    assert metrics["ppl_ratio"] == pytest.approx(expected["ppl_artifact"] / expected["ppl_base"], rel=1e-6)


def test_score_sequence_scores_only_the_output_positions():
    torch.manual_seed(1)
    logits_full, logits_quant = torch.randn(7, 16), torch.randn(7, 16)
    token_ids = [3, 1, 4, 1, 5, 9, 2]  # 4 prompt tokens, 3 output tokens
    score = score_sequence(logits_full, logits_quant, token_ids, 4)
    assert score.num_tokens == 3
    assert score == score_rows(logits_full[3:6], logits_quant[3:6], torch.tensor([5, 9, 2]))


def test_scores_add_up_token_weighted():
    a = ShadowScore(num_tokens=2, kld_sum=0.2, top1_matches=2, nll_full_sum=1.0, nll_quant_sum=1.0)
    b = ShadowScore(num_tokens=8, kld_sum=0.0, top1_matches=4, nll_full_sum=4.0, nll_quant_sum=4.0 + 8 * math.log(2))
    metrics = total([a, b]).metrics()
    assert metrics["kld_mean"] == pytest.approx(0.02)
    assert metrics["top1_pct"] == pytest.approx(60.0)
    assert metrics["ppl_ratio"] == pytest.approx(2 ** (8 / 10))
    assert ShadowScore().json()["kld_mean"] is None  # nothing scored: no NaN in JSON


def test_crossed_uses_the_gates_checks():
    window = ShadowScore(num_tokens=10, kld_sum=1.0, top1_matches=7, nll_full_sum=10.0, nll_quant_sum=10.0)
    assert crossed(window, gate_thresholds(kld=0.2, top1=None, ppl_increase=None)) == []
    assert crossed(window, gate_thresholds(kld=0.05, top1=80, ppl_increase=None)) == [
        "kld_mean 0.1 > 0.05",
        "top1_pct 70 < 80",
    ]
