"""Every supported architecture and RoPE variant against transformers, on tiny random models."""

import pytest
import torch

from optkit.models.loader import load_runtime_model
from tests.models.paged import chunked_then_decode, greedy_generate, run_paged, whole_prefills

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
)
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
ARCHITECTURES = {
    "llama-biases-yarn-untied": dict(
        model_type="llama", attention_bias=True, mlp_bias=True, rope_parameters=YARN, tie_word_embeddings=False
    ),
    "llama-llama3-tied": dict(model_type="llama", rope_parameters=LLAMA3, tie_word_embeddings=True),
    "mistral-linear": dict(
        model_type="mistral",
        sliding_window=None,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    ),
    "qwen2-tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3-head-dim": dict(model_type="qwen3", head_dim=32, attention_bias=True),
    # every multiplier far from 1 (attention's scale 1/√16 = 0.25 otherwise), so that each binds
    "granite-multipliers-biases": dict(
        model_type="granite",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.5,
        logits_scaling=8.0,
        attention_bias=True,
        mlp_bias=True,
    ),
    "granite-tied-yarn": dict(
        model_type="granite",
        embedding_multiplier=3.0,
        residual_multiplier=2.0,
        attention_multiplier=0.1,
        logits_scaling=0.25,
        tie_word_embeddings=True,
        rope_parameters=YARN,
    ),
    "olmo2-post-norms-qk-norms": dict(model_type="olmo2", attention_bias=True),
    "olmo2-mha-tied": dict(model_type="olmo2", num_key_value_heads=4, tie_word_embeddings=True),
    # fused qkv_proj / gate_up_proj; LongRoPE past its original context is in tests/models/test_phi3.py
    "phi3-fused-mha": dict(model_type="phi3", num_key_value_heads=4, pad_token_id=None),
    "phi3-mini-4k-sliding-window": dict(model_type="phi3", sliding_window=12, pad_token_id=None),
    "phi3-partial-rotary-gqa-tied": dict(
        model_type="phi3", partial_rotary_factor=0.5, tie_word_embeddings=True, pad_token_id=None
    ),
}


def tiny_model(tmp_path, name: str):
    """A tiny random transformers model of ARCHITECTURES[name], saved in tmp_path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    spec = dict(ARCHITECTURES[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **{**TINY, **spec})
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises biases to 0 and norms to 1: make them count
        for key, param in hf.named_parameters():
            if key.endswith("bias") or "norm" in key:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_logits_match_transformers(tmp_path, name):
    hf = tiny_model(tmp_path, name)
    model = load_runtime_model(tmp_path)
    sequences = [torch.randint(0, 256, (n,)).tolist() for n in (40, 7, 23)]  # past YaRN/llama3's 16
    with torch.no_grad():
        expected = [hf(torch.tensor([s])).logits[0] for s in sequences]
    lengths = [len(s) for s in sequences]
    for steps in (whole_prefills(lengths), chunked_then_decode(lengths, max_chunk=9)):
        for got, want in zip(run_paged(model, sequences, steps, block_size=4), expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_generation_matches_transformers(tmp_path, name):
    hf = tiny_model(tmp_path, name)
    model = load_runtime_model(tmp_path)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (11, 5)]
    new_tokens = 12
    got = greedy_generate(model, prompts, new_tokens, block_size=4)
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
            )
        assert tokens == expected[0, len(prompt) :].tolist()
