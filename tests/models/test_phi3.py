"""Phi-3's LongRoPE in the runtime against transformers, on tiny random models whose prompts run past
original_max_position_embeddings (and whose short and long factors differ enough to tell apart).

transformers picks the factors per forward by its max position + 1 (and, in generate, recomputes the
cache once a sequence crosses the original context); the runtime picks them once, by the engine's
context limit, as vLLM does (docs/runtime.md). Past the original context both use the long factors;
an engine limited to the original context uses the short ones, as transformers does there."""

import pytest
import torch

from optkit.models.loader import load_runtime_model
from tests.models.paged import chunked_then_decode, greedy_generate, run_paged, whole_prefills

ORIGINAL = 16
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    original_max_position_embeddings=ORIGINAL,
    initializer_range=0.1,
    pad_token_id=None,
)


def _longrope(rotary_dim: int) -> dict:
    n = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 1e4,
        "short_factor": [1.0 + 0.3 * i for i in range(n)],
        "long_factor": [2.0 + 4.0 * i for i in range(n)],
    }


VARIANTS = {
    "phi3.5-longrope": dict(rope_parameters=_longrope(16)),
    # Phi-4 mini: LongRoPE over the first half of each head, grouped-query attention
    "phi4-mini-partial-longrope": dict(partial_rotary_factor=0.5, rope_parameters=_longrope(8)),
}


def _tiny(tmp_path, name: str):
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    hf = Phi3ForCausalLM(Phi3Config(**TINY, **VARIANTS[name])).eval()
    with torch.no_grad():
        for key, param in hf.named_parameters():
            if "norm" in key:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path)
    return hf


def _expected(hf, sequences):
    with torch.no_grad():
        return [hf(torch.tensor([s])).logits[0] for s in sequences]


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_past_the_original_context_match_transformers(tmp_path, name):
    hf = _tiny(tmp_path, name)
    model = load_runtime_model(tmp_path)  # context limit 64 > 16: long factors
    sequences = [torch.randint(0, 256, (n,)).tolist() for n in (40, 17, 29)]
    lengths = [len(s) for s in sequences]
    expected = _expected(hf, sequences)
    for steps in (whole_prefills(lengths), chunked_then_decode(lengths, max_chunk=9)):
        for got, want in zip(run_paged(model, sequences, steps, block_size=4), expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", VARIANTS)
def test_an_engine_limited_to_the_original_context_uses_the_short_factors(tmp_path, name):
    hf = _tiny(tmp_path, name)
    model = load_runtime_model(tmp_path)
    sequences = [torch.randint(0, 256, (n,)).tolist() for n in (16, 7, 12)]
    lengths = [len(s) for s in sequences]
    long_logits = run_paged(model, sequences, whole_prefills(lengths), block_size=4)
    model.set_context_limit(ORIGINAL)
    expected = _expected(hf, sequences)
    for steps in (whole_prefills(lengths), chunked_then_decode(lengths, max_chunk=5)):
        for got, want in zip(run_paged(model, sequences, steps, block_size=4), expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # the factors bind: the long ones give other logits on the same short sequences
    assert (long_logits[0] - expected[0]).abs().max() > 1e-2


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_generation_matches_transformers_on_both_sides(tmp_path, name):
    hf = _tiny(tmp_path, name)
    model = load_runtime_model(tmp_path)

    def generate(prompt, new_tokens):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
        return out[0, len(prompt) :].tolist()

    long_prompt = torch.randint(0, 256, (20,)).tolist()  # past 16 from the start: long factors throughout
    assert greedy_generate(model, [long_prompt], 12, block_size=4) == [generate(long_prompt, 12)]
    model.set_context_limit(ORIGINAL)
    short_prompt = torch.randint(0, 256, (5,)).tolist()  # 5 + 11 = 16 tokens: short factors throughout
    assert greedy_generate(model, [short_prompt], 11, block_size=4) == [generate(short_prompt, 11)]


def test_the_engine_sets_the_factors_by_its_context_limit(tmp_path, draft_dir):
    import shutil

    from optkit.runtime.engine import LLMEngine
    from optkit.runtime.engine_args import EngineConfig

    _tiny(tmp_path, "phi3.5-longrope")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(draft_dir / file, tmp_path / file)
    within = LLMEngine(tmp_path, EngineConfig(max_model_len=ORIGINAL, kv_cache_blocks=8)).model
    beyond = LLMEngine(tmp_path, EngineConfig(kv_cache_blocks=32)).model  # the model's 64 positions
    assert torch.equal(within.inv_freq, within.config.rope_frequencies(ORIGINAL)[0])
    assert torch.equal(beyond.inv_freq, beyond.config.rope_frequencies(ORIGINAL + 1)[0])
    assert not torch.equal(within.inv_freq, beyond.inv_freq)


@pytest.mark.parametrize("name", VARIANTS)
def test_longrope_frequencies_equal_transformers_on_both_sides(name):
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from optkit.models.config import ModelConfig

    hf_config = Phi3Config(**TINY, **VARIANTS[name])
    rotary = Phi3RotaryEmbedding(hf_config)
    config = ModelConfig.from_hf(hf_config.to_dict())
    for seq_len in (ORIGINAL, ORIGINAL + 1):  # transformers' switch: max position + 1 > original
        x = torch.zeros(1)
        cos, _ = rotary(x, torch.arange(seq_len)[None])
        inv_freq, scaling = config.rope_frequencies(seq_len)
        assert torch.equal(rotary.inv_freq, inv_freq) and scaling == rotary.attention_scaling
        angles = torch.arange(seq_len)[:, None].float() * inv_freq[None]
        torch.testing.assert_close(cos[0], torch.cat((angles, angles), -1).cos() * scaling)
