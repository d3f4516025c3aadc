"""The runtime's mixture-of-experts block (models/moe.py) against transformers on tiny random Mixtral,
Qwen2-MoE (shared expert, a dense layer) and Qwen3-MoE models, and the engine's features on one."""

import pytest
import torch

from optkit.models.loader import load_runtime_model
from optkit.models.moe import MoEConfig, SparseMoE
from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams
from tests.models.paged import chunked_then_decode, greedy_generate, run_paged, whole_prefills
from tests.tiny_families import TINY, save_tiny_family

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, draft_dir):
    made = {}

    def make(name: str):
        if name not in made:
            made[name] = save_tiny_family(name, tmp_path_factory.mktemp("moe") / name, draft_dir)
        return made[name]

    return make


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_match_transformers(moe_model, family):
    path = moe_model(family)
    hf, model = _hf(path), load_runtime_model(path)
    torch.manual_seed(0)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,)).tolist() for n in (40, 7, 23)]
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0] for s in sequences]
    lengths = [len(s) for s in sequences]
    # whole prefills (grouped experts), then chunks of up to 9 and one-token decodes (the reference path)
    for steps in (whole_prefills(lengths), chunked_then_decode(lengths, max_chunk=9)):
        for got, want in zip(run_paged(model, sequences, steps, block_size=4), expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_generation_matches_transformers(moe_model, family):
    path = moe_model(family)
    hf, model = _hf(path), load_runtime_model(path)
    torch.manual_seed(1)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,)).tolist() for n in (11, 5)]
    got = greedy_generate(model, prompts, 12, block_size=4)
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert tokens == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_and_reference_paths_give_the_same_sum(renormalize):
    torch.manual_seed(0)
    moe = MoEConfig(
        num_experts=6,
        top_k=2,
        intermediate_size=24,
        renormalize=renormalize,
        sparse_layers=(0,),
        expert_linears=("w1", "w3", "w2"),
        shared_expert="shared_expert",
        shared_expert_gate="shared_expert_gate",
        shared_intermediate_size=16,
    )
    block = SparseMoE(32, moe)
    for tokens in (1, 5, 37):  # fewer tokens than experts, and more
        x = torch.randn(tokens, 32)
        with torch.no_grad():
            torch.testing.assert_close(block(x, grouped=True), block(x, grouped=False), atol=1e-6, rtol=1e-5)
            # by definition: each chosen expert's output times its routing weight, summed
            probs = torch.softmax(block.gate(x), dim=-1)
            weights, chosen = probs.topk(2, dim=-1)
            if renormalize:
                weights = weights / weights.sum(-1, keepdim=True)
            expected = torch.stack(
                [
                    sum(w * block.experts[e](row) for w, e in zip(ws, es.tolist(), strict=True))
                    for row, ws, es in zip(x, weights, chosen, strict=True)
                ]
            )
            expected += torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
            torch.testing.assert_close(block(x), expected, atol=1e-6, rtol=1e-5)


@pytest.fixture(scope="module")
def qwen2_moe_prompts(moe_model) -> list[list[int]]:
    torch.manual_seed(2)
    shared = torch.randint(0, TINY["vocab_size"], (40,)).tolist()
    passages = [torch.randint(0, TINY["vocab_size"], (n,)).tolist() for n in (20, 35, 12, 28, 50, 9)]
    # a shared 40-token prefix for prefix caching; repeats inside each prompt for n-gram lookup
    return [shared + p + p[:6] for p in passages]


def test_engine_features_keep_the_output_of_plain_decoding(moe_model, draft_dir, qwen2_moe_prompts):
    """Prefix caching, chunked prefill, preemption and speculative decoding (n-gram and a draft
    model) on an MoE target give plain greedy decoding's tokens."""
    path = moe_model("qwen2_moe")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLMEngine(path, EngineConfig(enable_prefix_caching=False)).generate(qwen2_moe_prompts, params)

    cached = LLMEngine(path, EngineConfig(block_size=8))
    first = cached.generate(qwen2_moe_prompts[:1], params)  # its blocks then serve the others' prefix
    assert first + cached.generate(qwen2_moe_prompts[1:], params) == plain
    assert cached.stats().num_prefix_cache_hit_tokens >= 5 * (40 // 8 * 8)

    chunked = LLMEngine(path, EngineConfig(max_num_batched_tokens=16, block_size=8))
    assert chunked.generate(qwen2_moe_prompts, params) == plain

    tight = LLMEngine(path, EngineConfig(kv_cache_blocks=20, block_size=8, enable_prefix_caching=False))
    assert tight.generate(qwen2_moe_prompts, params) == plain
    assert tight.stats().num_preemptions > 0

    for proposer in ("ngram", f"draft:{draft_dir}"):
        spec = LLMEngine(path, EngineConfig(speculative=proposer, num_speculative_tokens=4, block_size=8))
        assert spec.generate(qwen2_moe_prompts, params) == plain
