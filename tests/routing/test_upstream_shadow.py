"""Shadow scoring against an upstream's top-k (routing/online.py's score_rows_topk): with every
token it is the exact score, with fewer the KLD is a lower bound and the rest stays exact; and
vLLM's prompt_logprobs entries become its rows (upstream/prompt_logprobs.py)."""

import pytest
import torch

from optkit.routing.online import score_rows, score_rows_topk
from optkit.upstream.prompt_logprobs import _rows


def rows_of(logits: torch.Tensor, targets: torch.Tensor, k: int):
    logp = torch.log_softmax(logits, -1)
    top = logp.topk(k, -1)
    return top.indices, top.values, logp.gather(-1, targets[:, None]).squeeze(-1)


def test_the_topk_score_is_exact_with_the_whole_vocabulary_and_a_lower_bound_below_it():
    torch.manual_seed(0)
    full, quant = torch.randn(50, 64) * 3, torch.randn(50, 64) * 3
    targets = torch.randint(0, 64, (50,))
    exact = score_rows(full, quant, targets)
    for upstream_is_full in (True, False):
        remote, local = (full, quant) if upstream_is_full else (quant, full)
        whole = score_rows_topk(local, *rows_of(remote, targets, 64), targets, upstream_is_full)
        assert abs(whole.kld_sum - exact.kld_sum) < 1e-3 * exact.kld_sum
        some = score_rows_topk(local, *rows_of(remote, targets, 5), targets, upstream_is_full)
        assert some.kld_sum < exact.kld_sum
        assert some.top1_matches == exact.top1_matches and some.num_tokens == 50
        assert (
            abs(some.nll_full_sum - exact.nll_full_sum) < 1e-3 and abs(some.nll_quant_sum - exact.nll_quant_sum) < 1e-3
        )


def test_vllm_prompt_logprobs_become_rows_with_the_next_token():
    # vLLM's entries[i]: the distribution that predicts token i, its top k plus token i itself
    entries = [
        None,
        {"5": {"logprob": -0.1, "rank": 1}, "7": {"logprob": -2.5, "rank": 2}},
        {"9": {"logprob": -0.3, "rank": 1}, "5": {"logprob": -1.5, "rank": 2}, "3": {"logprob": -6.0, "rank": 40}},
    ]
    rows = _rows(entries, [1, 5, 3], first_row=0, k=2)
    assert rows.top_ids.tolist() == [[5, 7], [9, 5]]
    assert rows.target_logp.tolist() == pytest.approx([-0.1, -6.0])
    assert _rows(entries, [1, 5, 3], first_row=1, k=2).top_ids.tolist() == [[9, 5]]
