"""The runtime's CausalLM on the bundled `small` model against transformers, in float32."""

import pytest
import torch

from optkit.models.llama import CausalLM, kv_cache_shape
from optkit.models.loader import load_runtime_model
from tests.models.paged import chunked_then_decode, greedy_generate, prompts, run_paged, whole_prefills

LENGTHS = [5, 37, 200, 64]


@pytest.fixture(scope="module")
def small_prompts(small_dir):
    from optkit.modeldir import load_tokenizer

    return prompts(load_tokenizer(small_dir), LENGTHS)


@pytest.fixture(scope="module")
def hf_small(small_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runtime_small(small_dir) -> CausalLM:
    return load_runtime_model(small_dir)


@pytest.mark.parametrize("schedule", ["whole", "chunked"])
def test_logits_match_transformers(hf_small, runtime_small, small_prompts, schedule):
    """Acceptance: whole prefills, and chunked prefill + token-by-token decode, give transformers'
    logits (max abs diff < 1e-4) and the same greedy token at every position."""
    with torch.no_grad():
        expected = [hf_small(torch.tensor([p])).logits[0].float() for p in small_prompts]
    steps = whole_prefills(LENGTHS) if schedule == "whole" else chunked_then_decode(LENGTHS)
    got = run_paged(runtime_small, small_prompts, steps)
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() < 1e-4
        assert torch.equal(g.argmax(-1), e.argmax(-1))


def test_greedy_generation_matches_transformers(hf_small, runtime_small, small_prompts):
    new_tokens = 16
    got = greedy_generate(runtime_small, small_prompts[:3], new_tokens)
    for prompt, tokens in zip(small_prompts, got, strict=False):
        expected = hf_small.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
        expected = expected[0, len(prompt) :].tolist()
        assert tokens[: len(expected)] == expected


def test_the_model_exposes_what_the_runner_needs(runtime_small):
    config = runtime_small.config
    assert kv_cache_shape(config, 10, 16) == (10, 16, config.num_key_value_heads, config.head_dim)
    assert runtime_small.get_input_embeddings().weight.dtype == torch.float32
    assert runtime_small.lm_head is None and config.tie_word_embeddings  # logits reuse the embedding
    assert config.eos_token_ids == [0]
    assert not any(p.requires_grad for p in runtime_small.parameters())
