"""config.json is untrusted: every size the runtime builds a tensor from or divides by is checked
when the config is read, so that a crafted one ends in one OptkitError naming the key, never in a
ZeroDivisionError, a 16 GiB allocation or a SIGFPE inside a kernel; real configs still load."""

import json

import pytest

from optkit.errors import OptkitError
from optkit.modeldir import BUNDLED_DIR, read_config
from optkit.models.config import ModelConfig

DRAFT = json.loads((BUNDLED_DIR / "draft" / "config.json").read_text())

# (what changes, the fragment the error line names)
CRAFTED = {
    "zero heads": ({"num_attention_heads": 0}, "num_attention_heads"),
    "zero kv heads": ({"num_key_value_heads": 0}, "num_key_value_heads"),
    "a negative size": ({"intermediate_size": -5}, "intermediate_size"),
    "hidden size 0": ({"hidden_size": 0}, "hidden_size"),
    "no layers": ({"num_hidden_layers": 0}, "num_hidden_layers"),
    "heads as a string": ({"num_attention_heads": "4"}, "num_attention_heads"),
    "a size as a float": ({"hidden_size": 128.0}, "hidden_size"),
    "a size as a boolean": ({"hidden_size": True}, "hidden_size"),
    "head_dim 2^32": ({"head_dim": 2**32}, "head_dim"),
    "a vocabulary past 2^24": ({"vocab_size": 2**24 + 1}, "vocab_size"),
    "eos as a string": ({"eos_token_id": "0"}, "eos_token_id"),
    "a negative eos": ({"eos_token_id": [0, -1]}, "eos_token_id"),
    "heads not a multiple of kv heads": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "an odd head_dim (RoPE)": ({"head_dim": 31}, "head_dim"),
    "hidden not a multiple of heads, no head_dim": ({"hidden_size": 130, "head_dim": None}, "num_attention_heads"),
    "a negative eps": ({"rms_norm_eps": -1e-5}, "rms_norm_eps"),
    "an infinite eps": ({"rms_norm_eps": float("inf")}, "rms_norm_eps"),
    "rope parameters as a list": ({"rope_parameters": [1]}, "rope_parameters"),
    "model_type as a list": ({"model_type": ["llama"]}, "model_type"),
    "a context of 2^40": ({"max_position_embeddings": 2**40}, "max_position_embeddings"),
    "Llama 3 RoPE with an empty ramp": (
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        "low_freq_factor",
    ),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_config_is_one_error_naming_the_key(case):
    change, key = CRAFTED[case]
    config = {**DRAFT, **change}
    with pytest.raises(OptkitError, match=key):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("config", [[DRAFT], "llama", 3, None], ids=["list", "string", "number", "null"])
def test_a_config_that_is_not_an_object_is_one_error(config, tmp_path):
    with pytest.raises(OptkitError, match="not an object"):
        ModelConfig.from_hf(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(OptkitError, match="not an object"):
        read_config(tmp_path)


def test_moe_experts_per_token_past_the_experts_are_refused():
    moe = json.loads((BUNDLED_DIR / "small-moe" / "config.json").read_text())
    experts = moe.get("num_local_experts") or moe["num_experts"]
    with pytest.raises(OptkitError, match="num_experts_per_tok"):
        ModelConfig.from_hf({**moe, "num_experts_per_tok": experts + 1})


@pytest.mark.parametrize("model", ["draft", "small", "small-moe"])
def test_the_reference_models_configs_pass(model):
    config = read_config(BUNDLED_DIR / model)
    assert ModelConfig.from_hf(config).hidden_size == config["hidden_size"]


def test_configs_of_every_tiny_family_pass():
    """transformers' own config classes, as the compatibility matrix builds them (tests/tiny_families.py):
    a default, a null or a missing key of a real config is never refused."""
    transformers = pytest.importorskip("transformers")
    from tests.tiny_families import FAMILIES, TINY

    for overrides in FAMILIES.values():
        fields = {**TINY, **overrides}
        config_class = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        ModelConfig.from_hf(config_class.to_dict())


def test_generation_config_eos_must_be_token_ids():
    with pytest.raises(OptkitError, match="EOS token ids"):
        ModelConfig.from_hf(DRAFT, {"eos_token_id": "2"})
