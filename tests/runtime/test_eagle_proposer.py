"""Speculative decoding with an EAGLE head (runtime/eagle_proposer.py): exact whatever the head (greedy
output is plain decoding's on `small` and on tiny Qwen3 and Gemma 3 models), the head's KV at drafted
positions is recomputed from the target's real features, preemption and prefix caching leave outputs
alone and every head block free, sampled proposals follow the q they report, and a head trained for
another model is refused in one line."""

import pytest
import torch

from optkit.modeldir import read_config
from optkit.models.config import ModelConfig
from optkit.models.loader import load_runtime_model
from optkit.runtime.eagle_layer import layer_shapes
from optkit.runtime.eagle_proposer import EagleProposer
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams, Sequence, SequenceStatus
from optkit.speculative.eagle_head import load_head
from tests.runtime.eagle_heads import echo_head, random_head
from tests.tiny_families import save_tiny_family

PROMPTS = [
    [5, 17, 99, 1203, 8, 17, 99, 1203, 8, 17],
    [300 + i for i in range(23)],
    [7] * 6 + [9, 9, 7],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 1, 2, 3],
]


@pytest.fixture(scope="module")
def small_head(tmp_path_factory, small_dir):
    return random_head(small_dir, tmp_path_factory.mktemp("eagle") / "small-head")


def greedy_outputs(model_dir, prompts, speculative=None, **engine):
    config = EngineConfig(block_size=8, speculative=speculative, num_speculative_tokens=3, **engine)
    llm = LLMEngine(model_dir, config)
    return llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)), llm


@pytest.fixture(scope="module")
def small_echo_head(tmp_path_factory, small_dir):
    return echo_head(small_dir, tmp_path_factory.mktemp("eagle") / "small-echo")


@pytest.fixture(scope="module")
def small_plain(small_dir):
    return greedy_outputs(small_dir, PROMPTS, kv_cache_blocks=64)[0]


@pytest.mark.parametrize("head", ["random", "echo"])
def test_greedy_output_is_plain_decodings_on_small(small_dir, small_plain, small_head, small_echo_head, head):
    # random: every proposal rejected; echo: some accepted, some not (the KV rollback of both)
    spec, llm = greedy_outputs(small_dir, PROMPTS, f"eagle:{small_head if head == 'random' else small_echo_head}")
    assert spec == small_plain
    stats = llm.stats()
    assert stats.spec_proposer == "eagle" and stats.num_spec_draft_tokens > 0
    if head == "echo":
        assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_greedy_output_is_plain_decodings_on_other_families(tmp_path, small_dir, family):
    # Qwen3: q/k norms and attention biases; Gemma 3: sandwich norms, the scaled embedding, layer 0's
    # local RoPE base, soft-capped logits.
    model = save_tiny_family(family, tmp_path / family, small_dir)
    head = random_head(model, tmp_path / "head", scale=0.2)
    plain, _ = greedy_outputs(model, PROMPTS, kv_cache_blocks=64)
    spec, llm = greedy_outputs(model, PROMPTS, f"eagle:{head}", kv_cache_blocks=64)
    assert spec == plain and llm.stats().num_spec_draft_tokens > 0


def running(token_ids: list[int]) -> Sequence:
    seq = Sequence(token_ids, SamplingParams(temperature=0))
    seq.status = SequenceStatus.RUNNING
    return seq


def proposer_for(small_dir, head_dir) -> EagleProposer:
    target = load_runtime_model(small_dir)
    shapes = lambda config: layer_shapes(ModelConfig.from_hf(read_config(small_dir)), config)  # noqa: E731
    return EagleProposer(target, load_head(head_dir, small_dir, shapes), 64, 8, prefix_caching=True)


def head_keys(proposer: EagleProposer, seq: Sequence, positions: range) -> torch.Tensor:
    """The head's cached keys [len(positions), Hkv, D] at `positions` of `seq`."""
    table, bs = proposer._states[seq.seq_id].shadow.block_table, proposer.block_size
    k_cache = proposer.kv_cache[0]
    return torch.stack([k_cache[table[t // bs], t % bs] for t in positions])


def test_drafted_positions_are_recomputed_from_real_features_after_partial_acceptance(small_dir, small_head):
    proposer = proposer_for(small_dir, small_head)
    seq = running(PROMPTS[1])
    length = len(seq)
    proposer.observe(seq, 0, proposer._target_features(seq.token_ids)[:-1])
    [(drafts, _)] = proposer.propose([(seq, 4)])
    drafted = range(length - 1, length + 1)  # passes 2 and 3 wrote these from predicted features
    stale = head_keys(proposer, seq, drafted).clone()
    # The target accepts d_1, d_2 and rejects d_3: the step appends d_1, d_2 and its own token.
    seq.token_ids += [drafts[0], drafts[1], (drafts[2] + 1) % 4096]
    real = proposer._target_features(seq.token_ids)
    proposer.observe(seq, length - 1, real[length - 1 : length + 2])  # x_{L-1}, d_1, d_2
    [(again, _)] = proposer.propose([(seq, 4)])

    fresh = proposer_for(small_dir, small_head)  # a head that only ever saw real features
    copy = running(list(seq.token_ids))
    fresh.observe(copy, 0, fresh._target_features(copy.token_ids)[:-1])
    [(expected, _)] = fresh.propose([(copy, 4)])
    assert again == expected
    recomputed = head_keys(proposer, seq, drafted)
    torch.testing.assert_close(recomputed, head_keys(fresh, copy, drafted), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(recomputed, stale, atol=1e-3)  # they were drafted keys, now they are not


def test_sampled_proposals_follow_the_distribution_they_report(small_dir, small_head):
    # 1,000 copies of one sequence proposing at temperature 1 in one batch: d_1's frequencies are q_1's.
    proposer = proposer_for(small_dir, small_head)
    proposer.block_manager = type(proposer.block_manager)(4096, 8, False)
    proposer.kv_cache = tuple(torch.zeros(4096, *t.shape[1:]) for t in proposer.kv_cache)
    features = proposer._target_features(PROMPTS[0])[:-1]
    seqs = []
    for _ in range(1000):
        seq = Sequence(PROMPTS[0], SamplingParams(temperature=1.0, top_k=6))
        seq.status = SequenceStatus.RUNNING
        proposer.observe(seq, 0, features)
        seqs.append(seq)
    proposals = proposer.propose([(seq, 1) for seq in seqs])
    q = proposals[0][1][0]
    assert all(torch.allclose(p[1][0], q) for p in proposals)
    top = q.topk(6).indices
    counts = torch.tensor([sum(d[0] == t for d, _ in proposals) for t in top.tolist()], dtype=torch.float64)
    expected = q[top].double() * len(seqs)
    assert counts.sum() == len(seqs)  # top-k 6: nothing outside
    assert float(((counts - expected) ** 2 / expected).sum()) < 15.09  # chi-square, 5 dof, p = 0.01


def test_preemption_and_prefix_caching_keep_outputs_and_free_every_head_block(small_dir, small_plain, small_echo_head):
    plain, head_dir = small_plain, small_echo_head
    tight, llm = greedy_outputs(small_dir, PROMPTS, f"eagle:{head_dir}", kv_cache_blocks=12, max_num_seqs=4)
    assert tight == plain and llm.stats().num_preemptions > 0
    head = llm.decoding.proposer
    assert head.block_manager.num_free_blocks == head.block_manager.num_blocks and not head._states
    head.block_manager.check_invariants()

    # The same prompts again: the target and the head both take their prefixes from their caches.
    _, llm = greedy_outputs(small_dir, PROMPTS, f"eagle:{head_dir}", kv_cache_blocks=64)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    head = llm.decoding.proposer
    hits = head.block_manager.num_prefix_hit_tokens
    assert llm.generate(PROMPTS, params) == plain
    assert head.block_manager.num_prefix_hit_tokens > hits and head.num_recomputed_tokens == 0
    # A prompt that matches a cached one up to a block boundary, then differs: the target's hit is a
    # block longer than the head's (whose block needs the next token too), so the head runs the target
    # over the prefix for its features, and the output stays plain decoding's.
    prompt = PROMPTS[1][:16] + [11, 12, 13]
    assert llm.generate([prompt], params) == greedy_outputs(small_dir, [prompt], kv_cache_blocks=64)[0]
    assert head.num_recomputed_tokens > 0
    head.block_manager.check_invariants()


def test_a_head_for_another_model_is_refused_in_one_line(run_cli, draft_dir, small_head):
    code, out, err = run_cli("generate", draft_dir, "Hello", "--speculative", f"eagle:{small_head}")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "trained for another model" in lines[0], err


def test_generate_speculates_with_an_eagle_head(run_cli, small_dir, small_head):
    code, out, err = run_cli("generate", small_dir, "Once upon", "--max-tokens", "6", "--temperature", "0",
                             "--speculative", f"eagle:{small_head}", "--num-speculative-tokens", "2")  # fmt: skip
    assert code == 0, err
    assert out.strip()


# the chi-square critical values at p = 0.01 for 2, 4 and 6 degrees of freedom (any table)
CHI2_CRITICAL_1PCT = {2: 9.21, 4: 13.28, 6: 16.81}


def test_sampled_output_follows_the_target_with_a_head_that_is_partly_right(small_dir, small_echo_head):
    # 900 seeded requests at temperature 1, top-k 3: the second output token comes from a verification
    # step (one proposal, the echo head's, with its own distribution q), and follows the target's p
    # given the first, whatever was accepted.
    prompt = PROMPTS[3] + [11, 60, 60, 60]  # small goes on 60, 60, ...: the echo head's guess, often
    config = EngineConfig(block_size=8, speculative=f"eagle:{small_echo_head}", num_speculative_tokens=2,
                          max_num_seqs=256, max_num_batched_tokens=4096)  # fmt: skip
    llm = LLMEngine(small_dir, config)
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i, ignore_eos=True) for i in range(900)]
    outputs = llm.generate([prompt] * len(params), params)
    assert llm.stats().num_spec_accepted_tokens > 0 and llm.stats().spec_acceptance_rate < 1
    head = llm.decoding.proposer
    statistic, dof = 0.0, 0
    for first in {out[0] for out in outputs}:
        seconds = torch.tensor([out[1] for out in outputs if out[0] == first])
        if len(seconds) < 60:
            continue
        logits = llm.model.compute_logits(head._target_features(prompt + [first])[-1:])[0]
        top = logits.topk(3)
        p = top.values.softmax(dim=0).double()
        observed = torch.tensor([(seconds == t).sum() for t in top.indices.tolist()], dtype=torch.float64)
        assert observed.sum() == len(seconds)  # top-k 3: nothing else
        statistic += float(((observed - p * len(seconds)) ** 2 / (p * len(seconds))).sum())
        dof += 2
    assert dof and statistic < CHI2_CRITICAL_1PCT[dof]
