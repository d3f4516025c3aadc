"""Gemma 2, Gemma 3 and sliding windows in the runtime against transformers, on tiny random models
whose every feature binds: windows shorter than the prompts (across KV block boundaries), soft-caps
that bind, (1 + w) norms perturbed away from 1, Gemma 3's local RoPE base."""

import json
import logging

import pytest
import torch

from optkit.kernels.paged_attention import AttentionMetadata, paged_attention
from optkit.models.config import ModelConfig
from optkit.models.loader import load_runtime_model
from tests.kernels.paged_steps import paged_attention_reference
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
GEMMA3_TEXT = dict(
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=8,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    },
    final_logit_softcapping=2.0,
)
ARCHITECTURES = {
    # a window of 8 (< every prompt but one, across block boundaries of 4) on every layer
    "mistral-sliding-window": dict(model_type="mistral", sliding_window=8),
    # Gemma 2: window 8 on layer 0, soft-caps that bind (scores reach ~±3 at scale 1/√4, logits ~±3)
    "gemma2-softcaps-window-biases": dict(
        model_type="gemma2",
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=4,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=1.5,
        attention_bias=True,
    ),
    # Gemma 3: q/k norms, a local RoPE base on the sliding layer, linear scaling on the full one
    "gemma3-local-rope-untied": dict(model_type="gemma3_text", **GEMMA3_TEXT, tie_word_embeddings=False),
    # the multimodal Gemma3ForConditionalGeneration: the runtime runs its language model
    "gemma3-multimodal": dict(model_type="gemma3", **GEMMA3_TEXT),
}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)


def tiny_model(tmp_path, name: str):
    """A tiny random transformers model of ARCHITECTURES[name], saved in tmp_path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    spec = dict(ARCHITECTURES[name])
    model_type = spec.pop("model_type")
    if model_type == "gemma3":
        text = {**TINY, **spec, "model_type": "gemma3_text"}
        vision = {**VISION, "patch_size": 14}
        config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4)
    else:
        config = AutoConfig.for_model(model_type, **{**TINY, **spec})
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises biases and Gemma's norm weights to 0: make them count
        for key, param in hf.named_parameters():
            if key.endswith("bias") or "norm" in key:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_logits_match_transformers(tmp_path, name):
    hf = tiny_model(tmp_path, name)
    model = load_runtime_model(tmp_path)
    sequences = [torch.randint(0, 256, (n,)).tolist() for n in (40, 7, 23)]  # past the window of 8
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
    new_tokens = 12  # the first prompt's last tokens leave the window
    got = greedy_generate(model, prompts, new_tokens, block_size=4)
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
            )
        assert tokens == expected[0, len(prompt) :].tolist()


def test_the_features_bind(tmp_path):
    """Each Gemma feature changes the logits: the configs above would not catch a runtime without it."""
    from dataclasses import replace

    tiny_model(tmp_path, "gemma2-softcaps-window-biases")
    model = load_runtime_model(tmp_path)
    sequence = [torch.randint(0, 256, (40,)).tolist()]
    base = torch.cat(run_paged(model, sequence, whole_prefills([40]), block_size=4))
    for change in (
        dict(final_logit_softcapping=None),
        dict(attn_logit_softcapping=None),
        dict(sliding_window=None),
    ):
        config = replace(model.config, **change)
        other = load_runtime_model(tmp_path)
        other.config = config
        for i, layer in enumerate(other.model.layers):
            layer.self_attn.window, layer.self_attn.softcap = config.window(i), config.attn_logit_softcapping
        got = torch.cat(run_paged(other, sequence, whole_prefills([40]), block_size=4))
        assert (got - base).abs().max() > 1e-2, change


def test_the_multimodal_checkpoint_serves_its_language_model_and_says_so(tmp_path, caplog):
    tiny_model(tmp_path, "gemma3-multimodal")
    with caplog.at_level(logging.INFO, logger="optkit.models.loader"):
        model = load_runtime_model(tmp_path)
    assert not any("vision" in name for name, _ in model.named_parameters())
    assert any("vision_tower" in r.getMessage() and "full precision" in r.getMessage() for r in caplog.records)
    config = ModelConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert config.local_rope_parameters["rope_theta"] == 100.0 and config.window(0) == 8 and config.window(1) is None


def _random_step(query_lens, context_lens, block_size, heads, kv_heads, dim, num_blocks=64):
    """Random caches and q for one step, block tables drawn without overlap."""
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, slots = [], []
    for query_len, context_len in zip(query_lens, context_lens, strict=True):
        table = [order.pop() for _ in range(-(-context_len // block_size))]
        tables.append(table)
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(context_len - query_len, context_len)
        ]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, slots)
    q = torch.randn(sum(query_lens), heads, dim, generator=generator) * 3
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("window", [None, 1, 5, 8])
@pytest.mark.parametrize("softcap", [None, 0.7])
def test_paged_attention_windows_and_softcaps_match_the_reference(window, softcap):
    """Decodes, short groups (speculative verification) and long chunks, prefix cached or not."""
    query_lens, context_lens = [1, 1, 3, 3, 40, 37, 6], [9, 30, 12, 3, 40, 50, 6]
    q, k_cache, v_cache, meta = _random_step(query_lens, context_lens, 4, 4, 2, 16)
    got = paged_attention(q, k_cache, v_cache, meta, 0.25, window=window, softcap=softcap)
    want = paged_attention_reference(q, k_cache, v_cache, meta, 0.25, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
