import pytest
import torch

from optkit.errors import OptkitError
from optkit.models.config import ModelConfig

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def llama(**overrides):
    return {"model_type": "llama", **BASE, "num_key_value_heads": 2, "max_position_embeddings": 256, **overrides}


def test_llama():
    config = ModelConfig.from_hf(llama(eos_token_id=[2, 7], tie_word_embeddings=True, rms_norm_eps=1e-5))
    assert (config.head_dim, config.num_key_value_heads, config.rms_norm_eps) == (16, 2, 1e-5)
    assert config.tie_word_embeddings and config.eos_token_ids == [2, 7]
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias or config.qk_norm)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    biased = ModelConfig.from_hf(llama(attention_bias=True, mlp_bias=True, head_dim=32))
    assert biased.qkv_bias and biased.o_bias and biased.mlp_bias and biased.head_dim == 32


def test_mistral_and_its_sliding_window():
    config = ModelConfig.from_hf({"model_type": "mistral", **BASE, "sliding_window": None, "eos_token_id": 2})
    assert config.num_key_value_heads == 4 and config.eos_token_ids == [2]
    # every layer slides (tests/models/test_gemma.py runs it against transformers)
    windowed = ModelConfig.from_hf({"model_type": "mistral", **BASE, "sliding_window": 64})
    assert windowed.window(0) == windowed.window(1) == 64 and windowed.all_layers_slide
    # a window at least the model's longest context never takes effect
    config = ModelConfig.from_hf(
        {"model_type": "mistral", **BASE, "sliding_window": 512, "max_position_embeddings": 512}
    )
    assert config.window(0) is None and not config.all_layers_slide


def test_qwen2_and_qwen3():
    qwen2 = ModelConfig.from_hf({"model_type": "qwen2", **BASE, "sliding_window": 4096, "use_sliding_window": False})
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    with pytest.raises(OptkitError, match="sliding"):
        ModelConfig.from_hf(
            {"model_type": "qwen2", **BASE, "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}
        )
    qwen3 = ModelConfig.from_hf({"model_type": "qwen3", **BASE})
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 128  # transformers' Qwen3 default


def test_granite_and_olmo2_and_llama_defaults():
    granite = ModelConfig.from_hf(
        {"model_type": "granite", **BASE, "embedding_multiplier": 12, "residual_multiplier": 0.22,
         "attention_multiplier": 0.0078125, "logits_scaling": 8, "attention_bias": True, "mlp_bias": True}
    )  # fmt: skip
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (12.0, 0.22)
    assert (granite.attention_multiplier, granite.logits_scaling) == (0.0078125, 8.0)
    assert granite.qkv_bias and granite.o_bias and granite.mlp_bias and not granite.post_norms
    olmo2 = ModelConfig.from_hf({"model_type": "olmo2", **BASE, "attention_bias": True})
    assert olmo2.qk_norm == "full" and olmo2.post_norms and olmo2.norm_weight_in_float32
    assert olmo2.qkv_bias and olmo2.o_bias and not olmo2.mlp_bias and olmo2.attention_multiplier is None
    plain = ModelConfig.from_hf(llama(embedding_multiplier=12, logits_scaling=8))  # granite's keys count only there
    assert (plain.embedding_multiplier, plain.logits_scaling, plain.attention_multiplier) == (1.0, 1.0, None)
    assert ModelConfig.from_hf({"model_type": "qwen3", **BASE}).qk_norm == "head"


def test_eos_tokens_merge_the_generation_config():
    config = ModelConfig.from_hf(llama(eos_token_id=2), {"eos_token_id": [2, 9]})
    assert config.eos_token_ids == [2, 9]


def test_user_errors_name_the_setting():
    with pytest.raises(OptkitError, match="'gpt2'"):
        ModelConfig.from_hf({"model_type": "gpt2", **BASE})
    with pytest.raises(OptkitError, match="'longrope' without short_factor and long_factor"):
        ModelConfig.from_hf(llama(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}))
    with pytest.raises(OptkitError, match="'su'"):  # LongRoPE's old name, read as longrope by Phi-3 only
        ModelConfig.from_hf(llama(rope_parameters={"rope_type": "su", "rope_theta": 1e4}))
    with pytest.raises(OptkitError, match="hidden_size"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8})
    with pytest.raises(OptkitError, match="num_key_value_heads"):
        ModelConfig.from_hf(llama(num_key_value_heads=3))


ROPES = [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    {"rope_theta": 1e6},  # the old layout, no scaling
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}},
    {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},  # old layout, old key
    {"rope_theta": 1e4, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    {
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    },
    {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 0.8}},
    {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 40.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "beta_fast": 16,
            "truncate": False,
            "original_max_position_embeddings": 32,
        }
    },
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: str(r.get("rope_parameters", r.get("rope_scaling"))))
def test_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config_dict = llama(**rope)
    hf = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in config_dict.items() if k != "model_type"}))
    inv_freq, scaling = ModelConfig.from_hf(config_dict).rope_frequencies()
    assert torch.equal(inv_freq, hf.inv_freq) and scaling == hf.attention_scaling


def test_qwen_sliding_window_only_where_transformers_uses_it():
    qwen = {"model_type": "qwen2", **BASE, "sliding_window": 32, "max_position_embeddings": 128}
    ModelConfig.from_hf({**qwen, "use_sliding_window": False, "layer_types": ["sliding_attention"] * 2})
    ModelConfig.from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 2})  # no layer past 2
    with pytest.raises(OptkitError, match="sliding_window 32"):
        ModelConfig.from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 1})
