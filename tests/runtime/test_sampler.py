import math

import pytest
import torch

from optkit.runtime.sampler import Sampler, apply_min_p, apply_penalties, apply_top_k_top_p
from optkit.runtime.sequence import SamplingParams, Sequence

V = 32


def seqs(*params: SamplingParams, prompt=(1, 2, 3)) -> list[Sequence]:
    return [Sequence(list(prompt), p) for p in params]


def logits_for(n: int, seed=0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_for(4)
    result = Sampler()(logits, seqs(*[SamplingParams(temperature=0)] * 4))
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 4


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = logits_for(3)
    batch = seqs(SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0))
    result = Sampler()(logits, batch)
    assert result.token_ids[0] == logits[0].argmax() and result.token_ids[2] == logits[2].argmax()


def test_empty_batch():
    assert Sampler()(torch.zeros(0, V), []).token_ids == []


def draw_seeded(sampler: Sampler, seq: Sequence, logits_row: torch.Tensor, others: int, steps=5) -> list[int]:
    """Sample `steps` tokens for `seq`, batched with `others` unseeded neighbours at a random row."""
    tokens = []
    for i in range(steps):
        neighbours = seqs(*[SamplingParams(temperature=1.0, top_k=5)] * others)
        batch = neighbours[: i % (others + 1)] + [seq] + neighbours[i % (others + 1) :]
        logits = logits_for(len(batch), seed=100 + i)
        row = batch.index(seq)
        logits[row] = logits_row
        tokens.append(sampler(logits, batch).token_ids[row])
    return tokens


def test_seeded_sampling_does_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.5, top_p=0.9, seed=1234)
    row = torch.zeros(V)  # uniform: the draws are all the seed's doing
    alone = draw_seeded(Sampler(), Sequence([1], params), row, others=0)
    crowded = draw_seeded(Sampler(), Sequence([1], params), row, others=5)
    assert alone == crowded
    assert len(set(alone)) > 1
    other_seed = draw_seeded(Sampler(), Sequence([1], SamplingParams(temperature=1.5, top_p=0.9, seed=99)), row, 0)
    assert other_seed != alone


def test_forget_restarts_the_generator():
    sampler, seq = Sampler(), Sequence([1], SamplingParams(seed=7))
    first = [sampler(torch.zeros(1, V), [seq]).token_ids[0] for _ in range(4)]
    sampler.forget(seq.seq_id)
    again = [sampler(torch.zeros(1, V), [seq]).token_ids[0] for _ in range(4)]
    assert first == again


def sample_many(params: SamplingParams, logits_row: torch.Tensor, n=4000) -> torch.Tensor:
    """n draws of one row (batched as n rows), as counts per token."""
    torch.manual_seed(0)
    result = Sampler()(logits_row.expand(n, V).clone(), seqs(*[params] * n))
    return torch.bincount(torch.tensor(result.token_ids), minlength=V)


def test_temperature_one_matches_softmax():
    row = logits_for(1, seed=3)[0] / 3
    counts = sample_many(SamplingParams(temperature=1.0), row, n=20000)
    expected = torch.softmax(row, -1)
    assert (counts / counts.sum() - expected).abs().max() < 0.02


def test_top_k_restricts_the_support():
    row = logits_for(1, seed=4)[0] / 3
    counts = sample_many(SamplingParams(top_k=3), row)
    support = set(counts.nonzero().flatten().tolist())
    assert support == set(row.topk(3).indices.tolist())


def test_top_p_restricts_the_support():
    row = torch.full((V,), -10.0)
    row[[5, 6, 7]] = torch.tensor([0.5, 0.3, 0.2]).log()  # other tokens hold ~1e-4 in all
    counts = sample_many(SamplingParams(top_p=0.75), row)
    assert set(counts.nonzero().flatten().tolist()) == {5, 6}
    assert 0.55 < counts[5] / counts.sum() < 0.70  # renormalised 0.5 / 0.8


def test_min_p_restricts_the_support():
    row = torch.full((V,), -10.0)
    row[[1, 2, 3]] = torch.tensor([0.6, 0.3, 0.05]).log()
    counts = sample_many(SamplingParams(min_p=0.2), row)  # keep p >= 0.12
    assert set(counts.nonzero().flatten().tolist()) == {1, 2}


def test_filters_apply_per_row():
    logits = torch.zeros(2, 4)
    logits[:, 0] = 2.0
    logits[:, 1] = 1.0
    filtered = apply_top_k_top_p(logits, [1, 0], [1.0, 1.0])
    assert torch.isinf(filtered[0, 1:]).all() and not torch.isinf(filtered[1]).any()
    assert torch.equal(apply_min_p(logits, [0.0, 0.0]), logits)


def test_repetition_penalty_ctrl_rule():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    seq = Sequence([0, 1], SamplingParams(repetition_penalty=2.0))
    seq.append_token(1)
    out = apply_penalties(logits, [seq])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]  # seen: 0 (divided), 1 (multiplied)
    assert logits[0, 0] == 2.0  # the input is not modified


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(2, 5)
    a = Sequence([4, 4, 4], SamplingParams(frequency_penalty=0.5, presence_penalty=1.0))
    for t in (1, 1, 2):
        a.append_token(t)
    b = Sequence([1], SamplingParams())  # no penalty: row untouched
    b.append_token(1)
    out = apply_penalties(logits, [a, b])
    assert out[0].tolist() == [0.0, -2.0, -1.5, 0.0, 0.0]
    assert out[1].tolist() == [0.0] * 5


def test_penalties_steer_greedy():
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    seq = Sequence([0], SamplingParams(temperature=0, repetition_penalty=2.0))
    assert Sampler()(logits, [seq]).token_ids == [1]


def test_logprobs_come_from_the_raw_logits():
    logits = logits_for(3, seed=5)
    batch = seqs(
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.7, repetition_penalty=1.5, logprobs=0),
        SamplingParams(temperature=0),
    )
    result = Sampler()(logits, batch)
    expected = torch.log_softmax(logits, -1)
    first = result.logprobs[0]
    assert first.token_id == result.token_ids[0]
    assert math.isclose(first.logprob, expected[0, first.token_id].item(), rel_tol=1e-5)
    assert [t for t, _ in first.top] == expected[0].topk(3).indices.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(expected[0].topk(3).values.tolist())
    second = result.logprobs[1]
    assert second.top == [] and second.logprob == pytest.approx(expected[1, result.token_ids[1]].item())
    assert result.logprobs[2] is None
