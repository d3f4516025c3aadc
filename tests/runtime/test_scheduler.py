import random

import pytest

from optkit.runtime.block_manager import BlockManager
from optkit.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from optkit.runtime.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

EOS = 2


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256, caching=True) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len, eos_token_ids=(EOS,)
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, caching))


def fake_token(seq: Sequence) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far (never EOS)."""
    return 3 + (sum(seq.token_ids) * 31 + len(seq)) % 97


def step(sched: Scheduler, token=fake_token) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    sampled = {s.seq.seq_id: token(s.seq) for s in out.scheduled if s.samples}
    return out, sched.update(out, sampled)


def seq(n: int, max_tokens=16, start=10, request_id="", **kw) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, **kw), request_id)


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0, max_model_len=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0, max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_model_len=1)
    assert SchedulerConfig(max_model_len=16, eos_token_ids=[1, 2]).eos_token_ids == (1, 2)


def test_add_refuses_prompts_that_can_never_fit():
    sched = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="64 tokens but max_model_len is 64"):
        sched.add(seq(64))
    with pytest.raises(ValueError, match="need 5 KV-cache blocks .* only 4"):
        sched.add(seq(17))
    sched.add(seq(16, request_id="r"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(seq(3, request_id="r"))


def test_chunked_prefill_respects_the_budget():
    sched = make(budget=16)
    s = seq(40, max_tokens=2)
    sched.add(s)
    chunks = []
    while not s.is_finished:
        out, _ = step(sched)
        assert out.num_batched_tokens <= 16
        chunks.append(out.scheduled[0].num_new_tokens)
    assert chunks == [16, 16, 8, 1]
    assert s.num_output_tokens == 2 and s.finish_reason is FinishReason.LENGTH
    assert sched.num_prompt_tokens_computed == 40


def test_mixed_prefill_and_decode_in_one_step_fcfs():
    sched = make(budget=20)
    a, b, c = seq(5), seq(30, start=100), seq(4, start=200)
    for s in (a, b, c):
        sched.add(s)
    out, _ = step(sched)  # a's prefill (5) and the first 15 tokens of b; c must wait its turn
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(a, 5), (b, 15)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    assert c.status is SequenceStatus.WAITING and sched.num_waiting == 1
    out, _ = step(sched)  # a decodes, b finishes its prefill, c is admitted with the rest
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(a, 1), (b, 15), (c, 4)]
    assert out.num_batched_tokens == 20
    assert all(x.samples for x in out.scheduled)
    assert [s.num_output_tokens for s in (a, b, c)] == [2, 1, 1]


def test_max_num_seqs_limits_admission():
    sched = make(max_num_seqs=2)
    seqs = [seq(3, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out, _ = step(sched)
    assert [x.seq for x in out.scheduled] == seqs[:2] and sched.num_running == 2


def test_finish_on_eos_stop_token_max_tokens_and_model_len():
    sched = make(max_model_len=12)
    eos, stop, short, long_ = seq(3), seq(3, stop_token_ids=[50]), seq(3, max_tokens=2), seq(8, max_tokens=100)
    ignoring = seq(3, max_tokens=2, ignore_eos=True)
    for s in (eos, stop, short, long_, ignoring):
        sched.add(s)
    tokens = {eos.seq_id: EOS, stop.seq_id: 50, ignoring.seq_id: EOS}
    finished = []
    while sched.has_unfinished():
        finished += step(sched, lambda s: tokens.get(s.seq_id, 7))[1]
    assert (eos.finish_reason, eos.output_token_ids) == (FinishReason.STOP, [EOS])
    assert (stop.finish_reason, stop.output_token_ids) == (FinishReason.STOP, [50])
    assert (short.finish_reason, short.num_output_tokens) == (FinishReason.LENGTH, 2)
    assert (ignoring.finish_reason, ignoring.output_token_ids) == (FinishReason.LENGTH, [EOS, EOS])
    assert (long_.finish_reason, len(long_)) == (FinishReason.LENGTH, 12)
    assert set(finished) == {eos, stop, short, long_, ignoring}
    assert sched.block_manager.usage == 0.0


def test_finish_and_abort_free_blocks():
    sched = make()
    a, b, c = seq(9), seq(9, start=50), seq(9, start=90)
    for s in (a, b):
        sched.add(s)
    step(sched)
    sched.add(c)
    assert sched.block_manager.usage > 0
    assert sched.abort(a.request_id) and a.finish_reason is FinishReason.ABORT and a.block_table == []
    assert sched.abort(c.request_id) and sched.num_waiting == 0  # waiting ones too
    assert not sched.abort(a.request_id) and not sched.abort("nope")
    sched.finish(b, FinishReason.STOP)
    sched.finish(b, FinishReason.LENGTH)  # already finished: no-op
    assert b.finish_reason is FinishReason.STOP
    assert not sched.has_unfinished() and sched.block_manager.usage == 0.0


def test_preempts_the_newest_and_resumes_it_by_recomputing():
    # 6 blocks of 4 tokens: two sequences of 8-token prompts take 2 blocks each and grow.
    sched = make(num_blocks=6, block_size=4, budget=64, caching=False)
    old, new = seq(8, max_tokens=10), seq(8, start=50, max_tokens=10)
    sched.add(old)
    sched.add(new)
    step(sched)
    preempted_at = None
    for i in range(40):
        out, _ = step(sched)
        if out.preempted:
            preempted_at = i
            assert out.preempted == [new] and [x.seq for x in out.scheduled] == [old]
            assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
            assert new.block_table == [] and new.num_preemptions == 1 and sched.waiting[0] is new
            break
    assert preempted_at is not None
    generated_before = new.num_output_tokens
    while sched.has_unfinished():
        out, _ = step(sched)
        assert len(out.scheduled) <= 1 or not out.preempted
    assert sched.num_preemptions >= 1
    # Recomputation continues from the same tokens: the result is what an unpreempted run gives.
    assert new.num_output_tokens == 10 > generated_before
    alone = make(caching=False)
    ref = Sequence(new.prompt_token_ids, SamplingParams(max_tokens=10))
    alone.add(ref)
    while alone.has_unfinished():
        step(alone)
    assert ref.output_token_ids == new.output_token_ids
    assert sched.block_manager.usage == 0.0


def test_a_sequence_preempts_itself_when_it_is_the_newest():
    sched = make(num_blocks=3, block_size=4, budget=64, caching=False)
    a, b = seq(4, max_tokens=20), seq(4, start=50, max_tokens=20)
    sched.add(a)
    sched.add(b)
    step(sched)  # each holds 1 block (4 tokens computed, 5 in the sequence)
    out, _ = step(sched)  # a takes the last free block; b needs one: b preempts itself
    assert [x.seq for x in out.scheduled] == [a] and out.preempted == [b]


def test_second_request_with_the_same_prefix_only_prefills_the_rest():
    sched = make(num_blocks=64, block_size=16, budget=512, max_model_len=1024)
    prefix = [random.Random(0).randrange(3, 1000) for _ in range(200)]
    first = Sequence(prefix + [5, 6, 7], SamplingParams(max_tokens=3))
    sched.add(first)
    while sched.has_unfinished():
        step(sched)
    assert sched.num_prompt_tokens_computed == 203 and sched.num_prefix_cache_hit_tokens == 0
    second = Sequence(prefix + [8, 9], SamplingParams(max_tokens=3))
    sched.add(second)
    out, _ = step(sched)
    assert out.scheduled[0].num_new_tokens == 202 - 192  # 12 full blocks of 16 come from the cache
    assert second.num_cached_tokens == 192
    while sched.has_unfinished():
        step(sched)
    assert sched.num_prefix_cache_hit_tokens == 192
    assert sched.num_prompt_tokens_computed == 203 + 10
    assert sched.block_manager.usage == 0.0


def test_many_requests_with_a_fake_model():
    rng = random.Random(1)
    sched = make(num_blocks=40, block_size=8, max_num_seqs=6, budget=48, max_model_len=128)
    system = [rng.randrange(3, 500) for _ in range(20)]  # a shared prefix for half the requests
    seqs = []
    for i in range(64):
        prompt = (system if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))]
        s = Sequence(prompt, SamplingParams(max_tokens=rng.randrange(1, 40)))
        seqs.append(s)
        sched.add(s)
    finished, steps = [], 0
    while sched.has_unfinished():
        out, done = step(sched, lambda s: EOS if rng.random() < 0.02 else fake_token(s))
        assert 0 < out.num_batched_tokens <= 48
        assert len(out.scheduled) <= 6 and sched.num_running <= 6
        sched.block_manager.check_invariants()
        finished += done
        steps += 1
        assert steps < 5000
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert all(s.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for s in seqs)
    assert all(s.num_output_tokens <= s.params.max_tokens and len(s) <= 128 for s in seqs)
    assert sched.block_manager.usage == 0.0 and sched.num_prefix_cache_hit_tokens > 0
    assert sched.num_preemptions > 0  # 40 blocks of 8 cannot hold 6 long sequences at once


def test_growth_past_the_cache_finishes_with_length():
    sched = make(num_blocks=2, block_size=4, max_model_len=100)
    s = seq(3, max_tokens=50)
    sched.add(s)
    while sched.has_unfinished():
        step(sched)
    assert s.finish_reason is FinishReason.LENGTH and len(s) == 9  # the 9th token would need a third block


def multi_step(num_blocks=64, budget=32, steps=4) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_model_len=256, eos_token_ids=(EOS,), num_scheduler_steps=steps
    )
    return Scheduler(config, BlockManager(num_blocks, 4, True))


def decoding(sched: Scheduler, *seqs: Sequence) -> None:
    """Admit and prefill the sequences: each then decodes."""
    for s in seqs:
        sched.add(s)
    while any(len(s) - s.num_computed_tokens > 1 for s in seqs):
        step(sched)


def test_multi_steps_run_when_every_sequence_decodes_and_there_is_room():
    sched = multi_step()
    a, b = seq(6, max_tokens=20), seq(9, max_tokens=20)
    decoding(sched, a, b)
    out = sched.schedule()
    assert out.num_steps == 4 and [s.num_lookahead_tokens for s in out.scheduled] == [3, 3]
    sched.update(out, {a.seq_id: [5, 6, 7, 8], b.seq_id: [5, EOS, 7, 8]})
    assert a.output_token_ids[-4:] == [5, 6, 7, 8] and a.num_computed_tokens == len(a) - 1
    assert b.is_finished and b.output_token_ids[-1] == EOS  # the tokens after its stop dropped
    sched.block_manager.check_invariants()


def test_a_multi_step_runs_fewer_steps_the_more_sequences_decode():
    """At most MULTI_STEP_TOKENS tokens a multi-step: a request that arrives waits less at large batches."""
    from optkit.runtime.scheduler import MULTI_STEP_TOKENS

    sched = multi_step(budget=512, steps=8)
    decoding(sched, *[seq(5, max_tokens=20, start=10 + 7 * i) for i in range(17)])
    assert sched.schedule().num_steps == MULTI_STEP_TOKENS // 17 == 3


@pytest.mark.parametrize(
    "why", ["a request waits", "a penalty", "a prefill", "the budget", "the blocks", "one token left", "no setting"]
)
def test_a_step_decodes_one_token_when_a_multi_step_cannot_run(why):
    sched = multi_step(
        num_blocks=9 if why == "the blocks" else 64, budget=3 if why == "the budget" else 32,
        steps=1 if why == "no setting" else 4,
    )  # fmt: skip
    penalty = {"repetition_penalty": 1.2} if why == "a penalty" else {}
    a = seq(13, max_tokens=2 if why == "one token left" else 20, **penalty)
    b = seq(15, max_tokens=20, start=40)
    decoding(sched, a, b)  # 8 of 9 blocks held, 4 each: 4 steps need one more each
    if why == "a request waits":
        sched.add(seq(3, start=90))
    if why == "a prefill":
        sched.running[0].num_computed_tokens -= 2  # as after a preemption's recompute began
    out = sched.schedule()
    assert out.num_steps == 1 and all(s.num_lookahead_tokens == 0 for s in out.scheduled)
