"""The engine's one decoding: plain decoding samples one token per sequence from its row."""

import torch

from optkit.runtime.decoding import PlainDecoding
from optkit.runtime.sampler import Sampler
from optkit.runtime.scheduler import ScheduledSequence
from optkit.runtime.sequence import SamplingParams, Sequence


def test_plain_decoding_appends_each_rows_argmax_and_proposes_nothing():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=1)]
    seqs = [Sequence([1, 2, 3], p, f"r{i}") for i, p in enumerate(params)]
    scheduled = [ScheduledSequence(s, len(s)) for s in seqs]
    decoding = PlainDecoding()
    decoding.propose(scheduled)
    assert all(not item.spec_token_ids for item in scheduled)
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    tokens, logprobs = decoding.sample(logits, seqs, scheduled, Sampler())
    assert tokens == {seqs[0].seq_id: [1], seqs[1].seq_id: [0]}
    assert list(logprobs) == [seqs[1].seq_id] and len(logprobs[seqs[1].seq_id]) == 1
    assert decoding.stats.engine_fields() == {}
