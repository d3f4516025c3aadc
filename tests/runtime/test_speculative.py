"""Speculative decoding in the engine: greedy output is plain decoding's token for token with every
proposer (n-gram, a draft model, an untrained EAGLE head), stops land on the exact token, seeded
sampling is reproducible, and every KV block (the target's and the draft's) comes back, aborted
requests included. The fast checks use the
`draft` model as both target and proposer; the 50-prompt identity uses `small` as the target."""

import random
import time

import pytest

from optkit.errors import OptkitError
from optkit.runtime.block_manager import BlockManager
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.scheduler import Scheduler, SchedulerConfig
from optkit.runtime.sequence import FinishReason, SamplingParams, Sequence
from tests.runtime.eagle_heads import echo_head, random_head
from tests.runtime.test_engine import varied_prompts


@pytest.fixture(scope="module")
def heldout_ids(draft_dir) -> list[int]:
    from optkit.data.eval_sets import load_text_set
    from optkit.modeldir import load_tokenizer

    return load_tokenizer(draft_dir).encode("\n".join(load_text_set("heldout").texts[:40]))


def quoting_prompts(ids: list[int], n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a passage's start, so prompt lookup has something to find."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        start = rng.randrange(0, len(ids) - 80)
        passage = ids[start : start + rng.randint(20, 60)]
        prompts.append(passage + passage[: rng.randint(3, 10)])
    return prompts


def blocks_in_use(engine: LLMEngine) -> tuple[int, int]:
    """Blocks held by live sequences: the target's cache, and the draft's (0 when there is none)."""
    target = engine.block_manager
    target.check_invariants()
    draft = getattr(getattr(engine.decoding, "proposer", None), "block_manager", None)
    if draft is not None:
        draft.check_invariants()
    held = target.num_blocks - target.num_free_blocks
    return held, (draft.num_blocks - draft.num_free_blocks) if draft is not None else 0


@pytest.fixture(scope="module")
def plain(draft_dir) -> LLMEngine:
    return LLMEngine(draft_dir)


@pytest.fixture(scope="module", params=["ngram", "draft", "eagle"])
def spec(request, draft_dir, tmp_path_factory) -> LLMEngine:
    if request.param == "eagle":  # an untrained head: exactness must not depend on what it proposes
        proposer = f"eagle:{random_head(draft_dir, tmp_path_factory.mktemp('eagle') / 'head')}"
    else:
        proposer = "ngram" if request.param == "ngram" else f"draft:{draft_dir}"
    return LLMEngine(draft_dir, EngineConfig(speculative=proposer, num_speculative_tokens=4, block_size=8))


def test_greedy_batched_equals_plain_decoding(plain, spec, heldout_ids):
    prompts = varied_prompts(heldout_ids, 8, seed=11, lengths=(1, 120)) + quoting_prompts(heldout_ids, 6, seed=12)
    rng = random.Random(13)
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=0) for _ in prompts]
    before = spec.stats()
    outputs = spec.generate(prompts, params)
    assert outputs == plain.generate(prompts, params)
    stats = spec.stats()
    assert stats.num_spec_accepted_tokens > before.num_spec_accepted_tokens
    assert 0 < stats.spec_acceptance_rate <= 1 and stats.spec_mean_accepted_tokens > 0
    assert stats.num_generation_tokens - before.num_generation_tokens == sum(len(o) for o in outputs)
    assert blocks_in_use(spec) == (0, 0)


@pytest.fixture(scope="module")
def fifty(heldout_ids) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = varied_prompts(heldout_ids, 30, seed=81, lengths=(1, 200)) + quoting_prompts(heldout_ids, 20, seed=82)
    rng = random.Random(83)
    return prompts, [SamplingParams(max_tokens=rng.randint(1, 48), temperature=0) for _ in prompts]


@pytest.fixture(scope="module")
def small_plain_outputs(small_dir, fifty) -> list[list[int]]:
    return LLMEngine(small_dir, EngineConfig(max_num_batched_tokens=256)).generate(*fifty)


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_equals_plain_decoding_on_50_prompts_batched(small_dir, draft_dir, fifty, small_plain_outputs, proposer):
    speculative = "ngram" if proposer == "ngram" else f"draft:{draft_dir}"
    engine = LLMEngine(small_dir, EngineConfig(max_num_batched_tokens=256, speculative=speculative))
    assert engine.generate(*fifty) == small_plain_outputs
    assert engine.stats().num_spec_accepted_tokens > 0
    assert blocks_in_use(engine) == (0, 0)


@pytest.fixture(scope="module")
def bf16_requests(heldout_ids) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = varied_prompts(heldout_ids, 8, seed=91, lengths=(1, 150)) + quoting_prompts(heldout_ids, 6, seed=92)
    # counting and repeats, where an echoing head gets some right
    prompts += [[300 + i for i in range(23)], [*range(1, 17), 1, 2, 3], [7] * 6 + [9, 9, 7], [5, 17, 99, 1203, 8] * 2]
    rng = random.Random(93)
    return prompts, [SamplingParams(max_tokens=rng.randint(8, 40), temperature=0, ignore_eos=True) for _ in prompts]


@pytest.fixture(scope="module")
def bf16_rows_round_alike(small_dir) -> bool:
    """Whether small's bf16 linears, as the loader sets them up on this CPU (oneDNN's packed bf16
    where it has a bf16 path), give a row the same bits alone and among 8: what a verification's
    exactness rests on besides attention."""
    import torch

    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(small_dir, dtype=torch.bfloat16)
    x = torch.randn(8, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        linear = model.model.layers[0].self_attn.o_proj
        return torch.equal(torch.cat([linear(x[i : i + 1]) for i in range(8)]), linear(x))


@pytest.mark.parametrize("proposer", ["ngram", "draft", "eagle"])
def test_greedy_in_bfloat16_on_the_cpu_equals_plain_decoding(
    small_dir, draft_dir, bf16_requests, bf16_rows_round_alike, proposer, tmp_path
):
    """bfloat16 rounds far coarser than float32, so the verification's rows must get exactly plain
    decoding's bits for greedy output to match (paged_attention's short chunks through the decode
    kernel; the linears give each row the same bits whatever the row count)."""
    if not bf16_rows_round_alike:
        pytest.skip("this CPU's bf16 matmul rounds a row by the row count (docs/runtime.md)")
    if proposer == "eagle":
        speculative = f"eagle:{echo_head(small_dir, tmp_path / 'head')}"  # accepts some, rejects some
    else:
        speculative = "ngram" if proposer == "ngram" else f"draft:{draft_dir}"
    config = {"dtype": "bfloat16", "block_size": 8, "max_num_batched_tokens": 256}
    plain = LLMEngine(small_dir, EngineConfig(**config)).generate(*bf16_requests)
    engine = LLMEngine(small_dir, EngineConfig(**config, speculative=speculative, num_speculative_tokens=3))
    assert engine.generate(*bf16_requests) == plain
    assert engine.stats().num_spec_accepted_tokens > 0
    assert blocks_in_use(engine) == (0, 0)


def test_stops_apply_at_the_exact_token(plain, spec, heldout_ids):
    prompt = quoting_prompts(heldout_ids, 1, seed=21)[0]
    free = plain.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop_token = free[len(free) // 2]
    cut = free[: free.index(stop_token) + 1]
    stopped = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_token])
    assert spec.generate([prompt], stopped)[0] == cut
    for n in (1, 2, 5, 13):
        assert spec.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0] == free[:n]
    assert blocks_in_use(spec) == (0, 0)


def test_stop_string_cuts_at_the_token_that_completes_it(plain, spec, heldout_ids):
    prompt = quoting_prompts(heldout_ids, 1, seed=22)[0]
    texts: dict[str, list] = {"plain": [], "spec": []}
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain.generate([prompt], free, lambda i, o: texts["plain"].append(o))
    text = "".join(o.text for o in texts["plain"])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    texts = {"plain": [], "spec": []}
    expected = plain.generate([prompt], params, lambda i, o: texts["plain"].append(o))[0]
    generated_before = spec.stats().num_generation_tokens
    got = spec.generate([prompt], params, lambda i, o: texts["spec"].append(o))[0]
    assert got == expected
    assert "".join(o.text for o in texts["spec"]) == "".join(o.text for o in texts["plain"])
    assert texts["spec"][-1].finish_reason == "stop"
    assert spec.stats().num_generation_tokens - generated_before == len(got)  # the tokens past it never count


def test_max_model_len_stops_at_the_exact_token(draft_dir, heldout_ids):
    prompt = heldout_ids[:50]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    plain = LLMEngine(draft_dir, EngineConfig(max_model_len=64)).generate([prompt], params)[0]
    spec = LLMEngine(draft_dir, EngineConfig(max_model_len=64, speculative="ngram")).generate([prompt], params)[0]
    assert spec == plain and len(spec) == 14


def test_blocks_return_to_zero_with_sampling_and_aborts(spec, heldout_ids):
    prompts = quoting_prompts(heldout_ids, 10, seed=31)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=30, temperature=0.8 if i % 2 else 0, top_k=20, seed=i if i % 3 else None)
        spec.add_request(prompt, params, f"r{i}")
    for _ in range(3):
        spec.step()
    assert blocks_in_use(spec)[0] > 0
    for i in (0, 3, 4, 7):
        spec.abort(f"r{i}")
    while spec.has_unfinished():
        spec.step()
    assert not spec.requests
    assert blocks_in_use(spec) == (0, 0)


def test_async_streams_with_speculation_and_a_consumer_that_leaves(draft_dir, heldout_ids):
    import asyncio

    from optkit.runtime.async_engine import AsyncEngine

    engine = AsyncEngine.start(draft_dir, EngineConfig(speculative=f"draft:{draft_dir}"))
    prompts = quoting_prompts(heldout_ids, 3, seed=101)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def collect(prompt: list[int], request_id: str, stop_after: int | None = None) -> list[int]:
        tokens = []
        stream = engine.generate(prompt, params, request_id)
        async for output in stream:
            tokens += output.token_ids
            if stop_after is not None and len(tokens) >= stop_after:
                await stream.aclose()
                break
        return tokens

    async def main():
        return await asyncio.gather(collect(prompts[0], "a"), collect(prompts[1], "b", 3), collect(prompts[2], "c"))

    try:
        full, cut, other = asyncio.run(main())
        draft_blocks = engine.engine.decoding.proposer.block_manager
        deadline = time.monotonic() + 10  # the abort reaches the engine thread through its inbox
        while (engine.stats().kv_cache_usage or draft_blocks.usage) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        engine.shutdown()
    assert blocks_in_use(engine.engine) == (0, 0)
    expected = engine.engine.generate(prompts, params)  # the engine thread has stopped
    assert [full, other] == [expected[0], expected[2]] and cut == expected[1][: len(cut)]


def test_seeded_sampling_is_reproducible_whatever_the_batch(spec, heldout_ids):
    prompt = quoting_prompts(heldout_ids, 1, seed=41)[0]
    params = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=7, repetition_penalty=1.1)
    alone = spec.generate([prompt], params)[0]
    others = varied_prompts(heldout_ids, 5, seed=42, lengths=(5, 50))
    batched = spec.generate([*others, prompt], [SamplingParams(max_tokens=30, temperature=1.0)] * 5 + [params])[-1]
    assert alone == batched
    assert spec.generate([prompt], SamplingParams(max_tokens=30, temperature=1.0, seed=8))[0] != alone


def test_logprobs_match_plain_decoding(plain, spec, heldout_ids):
    prompt = quoting_prompts(heldout_ids, 1, seed=51)[0]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=2)
    got: dict[str, list] = {"plain": [], "spec": []}
    plain.generate([prompt], params, lambda i, o: got["plain"].extend(o.logprobs))
    spec.generate([prompt], params, lambda i, o: got["spec"].extend(o.logprobs))
    assert [t.token_id for t in got["spec"]] == [t.token_id for t in got["plain"]]
    assert [t.logprob for t in got["spec"]] == pytest.approx([t.logprob for t in got["plain"]], abs=1e-4)
    assert [[i for i, _ in t.top] for t in got["spec"]] == [[i for i, _ in t.top] for t in got["plain"]]


def test_a_request_can_opt_out(draft_dir, heldout_ids):
    engine = LLMEngine(draft_dir, EngineConfig(speculative="ngram"))
    prompt = quoting_prompts(heldout_ids, 1, seed=61)[0]
    engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, speculative=False))
    assert engine.stats().num_spec_steps == 0
    engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0))
    assert engine.stats().num_spec_steps > 0 and engine.stats().spec_proposer == "ngram"


def test_prefix_cache_never_serves_rejected_proposals(draft_dir, heldout_ids):
    # The same prompts twice: the second run takes their blocks from the prefix cache. A block
    # hashed while it held a rejected proposal's KV would change the second run's tokens.
    engine = LLMEngine(draft_dir, EngineConfig(speculative="ngram", block_size=4))
    prompts = quoting_prompts(heldout_ids, 6, seed=71)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = engine.generate(prompts, params)
    continued = [p + o for p, o in zip(prompts, first, strict=True)]
    before = engine.stats().num_prefix_cache_hit_tokens
    again = engine.generate(continued, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert engine.stats().num_prefix_cache_hit_tokens - before > sum(len(p) for p in prompts)
    plain = LLMEngine(draft_dir, EngineConfig(enable_prefix_caching=False))
    assert again == plain.generate(continued, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))


def test_preemption_does_not_change_outputs_nor_leak(draft_dir, heldout_ids):
    prompts = quoting_prompts(heldout_ids, 8, seed=91)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = LLMEngine(draft_dir).generate(prompts, params)
    for proposer in ("ngram", f"draft:{draft_dir}"):
        tight = LLMEngine(draft_dir, EngineConfig(kv_cache_blocks=24, block_size=8, speculative=proposer))
        assert tight.generate(prompts, params) == roomy
        assert tight.stats().num_preemptions > 0
        assert blocks_in_use(tight) == (0, 0)


def test_a_draft_equal_to_the_target_is_always_accepted_when_sampling(draft_dir, heldout_ids):
    # p and q go through the same penalties, temperature, top-k and top-p: with the target as its
    # own draft, p = q (up to rounding) and min(1, p / q) accepts every proposal. A mismatch in how
    # either is processed would show as rejections.
    engine = LLMEngine(draft_dir, EngineConfig(speculative=f"draft:{draft_dir}"))
    params = SamplingParams(max_tokens=30, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=3)
    engine.generate(quoting_prompts(heldout_ids, 4, seed=92), params)
    assert engine.stats().spec_acceptance_rate > 0.97


def test_config_errors_name_the_option():
    with pytest.raises(OptkitError, match="unknown --speculative 'eagle'"):
        EngineConfig(speculative="eagle")
    with pytest.raises(OptkitError, match="--num-speculative-tokens 8 leaves no room"):
        EngineConfig(speculative="ngram", num_speculative_tokens=8, max_num_batched_tokens=8)
    with pytest.raises(OptkitError, match="--num-speculative-tokens must be at least 1"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)


# The scheduler alone (no torch): lookahead slots, budget, rollback.


def scheduler(budget: int = 64, k: int = 3, num_blocks: int = 32) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget, max_model_len=64, eos_token_ids=(2,), num_speculative_tokens=k
    )
    return Scheduler(config, BlockManager(num_blocks, block_size=4))


def decoding(sched: Scheduler, prompt_len: int = 6, max_tokens: int = 20) -> Sequence:
    seq = Sequence(list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens))
    sched.add(seq)
    out = sched.schedule()
    assert [s.num_lookahead_tokens for s in out.scheduled if s.seq is seq] == [0]  # a prefill proposes nothing
    sched.update(out, {seq.seq_id: 50})
    return seq


def test_rejected_proposals_give_their_blocks_back_unhashed():
    sched = scheduler()
    seq = decoding(sched)  # 7 tokens, 6 computed, in 2 blocks of 4
    out = sched.schedule()
    item = out.scheduled[0]
    assert (item.num_new_tokens, item.num_lookahead_tokens, out.num_batched_tokens) == (1, 3, 4)
    assert len(seq.block_table) == 3  # room for positions 6..9
    item.spec_token_ids = [60, 61, 62]
    sched.update(out, {seq.seq_id: [60, 70]})  # d_1 accepted, d_2 rejected: 70 is the target's own
    assert seq.token_ids[-3:] == [50, 60, 70] and seq.num_computed_tokens == 8
    assert len(seq.block_table) == 2  # block 3 only held rejected proposals
    blocks = sched.block_manager.blocks
    assert blocks[seq.block_table[0]].hash is not None and blocks[seq.block_table[1]].hash is not None
    sched.block_manager.check_invariants()


def test_a_stop_inside_the_accepted_run_drops_the_rest():
    sched = scheduler()
    seq = decoding(sched)
    out = sched.schedule()
    out.scheduled[0].spec_token_ids = [60, 2, 61]
    finished = sched.update(out, {seq.seq_id: [60, 2, 61, 70]})  # 2 is EOS
    assert finished == [seq] and seq.output_token_ids == [50, 60, 2] and seq.finish_reason is FinishReason.STOP
    assert sched.block_manager.usage == 0


def test_lookahead_is_capped_by_max_tokens_and_all_or_nothing_in_the_budget():
    sched = scheduler()
    short = Sequence(list(range(10, 16)), SamplingParams(max_tokens=3))
    long_ = Sequence(list(range(20, 26)), SamplingParams(max_tokens=20))
    sched.add(short)
    sched.add(long_)
    sched.update(sched.schedule(), {short.seq_id: 50, long_.seq_id: 50})  # both prefilled, one token out
    sched.config.max_num_batched_tokens = 5
    out = sched.schedule()  # short may add 2 more tokens: 1 proposal; long_ needs 1 + 3 > 5 - 2: waits
    assert [(s.seq, s.num_lookahead_tokens) for s in out.scheduled] == [(short, 1)]
    sched.update(out, {short.seq_id: 51})
    out = sched.schedule()  # short has 1 token left: no proposal
    assert [(s.seq, s.num_lookahead_tokens) for s in out.scheduled] == [(short, 0), (long_, 3)]
    sched.update(out, {short.seq_id: 52, long_.seq_id: 51})
    assert short.is_finished and short.num_output_tokens == 3
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SchedulerConfig(max_num_batched_tokens=4, max_model_len=64, num_speculative_tokens=4)


class RecordingProposer:
    """Proposes 1, 2, 3, ... (as many as asked) and records how many it was asked for."""

    name = "stub"

    def __init__(self):
        self.asked: list[int] = []

    def propose(self, items):
        self.asked += [k for _, k in items]
        return [(list(range(1, k + 1)), None) for _, k in items]

    def release(self, seq):
        pass


def test_proposal_length_adapts_to_what_was_accepted():
    import torch

    from optkit.runtime.sampler import Sampler
    from optkit.runtime.scheduler import ScheduledSequence
    from optkit.runtime.speculative import Speculator

    proposer = RecordingProposer()
    speculator = Speculator(proposer, num_speculative_tokens=8)
    seq = Sequence([5, 6, 7], SamplingParams(temperature=0))

    def step(target: list[int]) -> list[int]:
        """One step whose target argmax is `target` at each row."""
        item = ScheduledSequence(seq, 1, num_lookahead_tokens=8)
        speculator.propose([item])
        logits = torch.zeros(len(item.spec_token_ids) + 1, 16)
        logits[torch.arange(len(target)), torch.tensor(target)] = 1.0
        return speculator.sample(logits, [seq], [item], Sampler())[0][seq.seq_id]

    assert step([1, 2, 9, 0, 0, 0, 0, 0, 0]) == [1, 2, 9]  # rejected at d_3: next time at most 3
    assert step([1, 2, 3, 4]) == [1, 2, 3, 4]  # all accepted: next time up to 6
    assert step([1, 9, 0, 0, 0, 0, 0]) == [1, 9]
    assert proposer.asked == [8, 3, 6]
    stats = speculator.stats
    assert (stats.num_steps, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 17, 6)
