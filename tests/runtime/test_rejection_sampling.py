"""The math of speculative decoding on synthetic distributions: modified rejection sampling emits
tokens distributed as the target's, whatever the draft; without its correction step it does not.
Also the n-gram lookup, a pure function."""

import pytest
import torch

from optkit.runtime import speculative
from optkit.runtime.proposers import NgramProposer
from optkit.runtime.speculative import rejection_sample

V, K, N = 8, 3, 20_000
# The chi-square critical value for V - 1 = 7 degrees of freedom at p = 0.01 (any table; scipy's
# chi2.ppf(0.99, 7) = 18.475): a statistic above it rejects "the samples follow p" at the 1% level.
CHI2_CRITICAL_7_DOF = 18.475

# Target p_1..p_{K+1} and a deliberately bad draft q_1..q_K: q favours what p rarely picks.
P = torch.tensor(
    [
        [0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02],
        [0.05, 0.05, 0.10, 0.30, 0.20, 0.10, 0.10, 0.10],
        [0.125] * 8,
        [0.02, 0.08, 0.10, 0.10, 0.10, 0.15, 0.20, 0.25],
    ]
)
Q = torch.tensor(
    [
        [0.02, 0.03, 0.05, 0.05, 0.10, 0.15, 0.20, 0.40],
        [0.40, 0.30, 0.10, 0.02, 0.03, 0.05, 0.05, 0.05],
        [0.70, 0.10, 0.05, 0.05, 0.04, 0.03, 0.02, 0.01],
    ]
)


def run(draft: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """N independent rows of the same p and q; the drafts are drawn from q ("model") or all 3 (a
    point mass, as the n-gram proposer's)."""
    g = torch.Generator().manual_seed(seed)
    target = P.expand(N, K + 1, V)
    if draft == "model":
        draft_ids = torch.multinomial(Q, N, replacement=True, generator=g).T  # [N, K], column i ~ q_i
        draft_probs = Q.expand(N, K, V)
    else:
        draft_ids, draft_probs = torch.full((N, K), 3), None
    uniform = torch.rand(N, K, generator=g)
    noise = torch.empty(N, V).exponential_(generator=g)
    return rejection_sample(target, draft_probs, draft_ids, torch.full((N,), K), uniform, noise)


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=V).double()
    expected = p.double() * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", ["model", "point_mass"])
def test_emitted_tokens_follow_the_target(draft):
    out, num_accepted = run(draft)
    assert chi_square(out[:, 0], P[0]) < CHI2_CRITICAL_7_DOF
    # Where d_1 was kept, the next token is p_2's (p_2 here does not depend on d_1).
    second = out[num_accepted >= 1, 1]
    assert len(second) > 1000
    assert chi_square(second, P[1]) < CHI2_CRITICAL_7_DOF


def test_without_the_correction_the_test_fails(monkeypatch):
    # Resampling from p instead of max(0, p - q) after a rejection over-weights what q favours.
    monkeypatch.setattr(speculative, "residual_probs", lambda p, q: p)
    out, _ = run("model")
    assert chi_square(out[:, 0], P[0]) > 10 * CHI2_CRITICAL_7_DOF


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    _, num_accepted = run("model")
    overlap = torch.minimum(P[0], Q[0]).sum()  # P(accept d_1) = sum_x min(p(x), q(x))
    assert abs((num_accepted >= 1).float().mean() - overlap) < 0.01


def test_output_layout_and_ragged_rows():
    # Row 0: two proposals, both right under a point-mass p; row 1: one proposal, wrong; row 2: none.
    p = torch.zeros(3, 3, V)
    p[0, 0, 5] = p[0, 1, 6] = p[0, 2, 7] = 1.0
    p[1, 0, 2] = p[1, 1, 1] = 1.0
    p[2, 0, 4] = 1.0
    drafts = torch.tensor([[5, 6], [3, 0], [0, 0]])
    out, num_accepted = rejection_sample(
        p, None, drafts, torch.tensor([2, 1, 0]), torch.rand(3, 2), torch.empty(3, V).exponential_()
    )
    assert num_accepted.tolist() == [2, 0, 0]
    assert out.tolist() == [[5, 6, 7], [2, -1, -1], [4, -1, -1]]


def test_twenty_thousand_samples_take_well_under_a_second():
    import time

    start = time.perf_counter()
    run("model")
    assert time.perf_counter() - start < 0.5


def test_ngram_lookup_takes_the_longest_then_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert NgramProposer(max_n=2).lookup(tokens, 3) == [4, 5, 7]  # "2 3" last followed by 4 5 7, not 9
    assert NgramProposer(max_n=3).lookup(tokens, 3) == [4, 5]  # "7 2 3" never occurred: the 2-token match
    assert NgramProposer().lookup([1, 2, 3, 1, 2, 3, 1, 2], 2) == [3, 1]  # "2 3 1 2" occurred at 1
    assert NgramProposer().lookup([5, 6, 7], 4) == []
    assert NgramProposer(max_n=1).lookup([8, 8], 4) == [8, 8, 8, 8]  # a loop goes on past the end
    assert NgramProposer(max_n=2).lookup([5, 6, 7, 5, 6], 5) == [7, 5, 6, 7, 5]
    assert NgramProposer(min_n=3).lookup([1, 2, 3, 1, 2], 2) == []


def test_ngram_proposer_proposes_as_many_tokens_as_the_match_is_long():
    proposer = NgramProposer(min_n=1, max_n=3)
    assert proposer.lookup([1, 2, 3, 4, 5, 6, 9, 2], 4) == [3]  # a 1-token match: 1 proposal
    assert proposer.lookup([1, 2, 3, 4, 5, 6, 1, 2], 4) == [3, 4]
    assert proposer.lookup([1, 2, 3, 4, 5, 6, 1, 2, 3], 4) == [4, 5, 6, 1]  # max_n tokens: k proposals


def test_ngram_lookup_matches_on_token_boundaries_only():
    # 256 and 1 share bytes across a token boundary in the int32 encoding: no false match.
    tokens = [0, 1, 0, 0, 256, 0, 1, 2, 256]  # "256" occurs at index 4 only, followed by 0
    assert NgramProposer(max_n=1).lookup(tokens, 2) == [0, 1]
    assert NgramProposer(max_n=1).lookup([1 << 8, 1, 7, 1], 1) == [7]
