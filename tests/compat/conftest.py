"""Artifacts for the compatibility matrix, and the recorder that bench/compat_matrix.py reads.

Set OPTKIT_COMPAT_RESULTS=FILE to have every cell's outcome appended to FILE (JSON lines)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

# Tiny random models of each supported family, with the reference tokenizer (vocab 4096) so the
# calibrated methods can tokenize their calibration text. Sizes are multiples of 32 (GPTQ packing).
TINY = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.05,
)
FAMILIES = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", head_dim=32, attention_bias=True),
    "granite": dict(
        model_type="granite",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0625,
        logits_scaling=0.125,  # below 1: sharper logits, so that a KLD gate means something
    ),
    "olmo2": dict(model_type="olmo2", num_key_value_heads=4),  # no GQA: AWQ's v → o fold applies
}


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory, draft_dir):
    """family name -> a tiny random model of that family (norms and biases perturbed so they count)."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name in made:
            return made[name]
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        spec = dict(FAMILIES[name])
        config = AutoConfig.for_model(spec.pop("model_type"), **{**TINY, **spec})
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for key, param in model.named_parameters():
                if key.endswith("bias") or "norm" in key:
                    param.add_(torch.randn_like(param) * 0.1)
        out = tmp_path_factory.mktemp("families") / name
        model.save_pretrained(out)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(draft_dir / file, out / file)
        made[name] = out
        return out

    return make


@pytest.fixture(scope="session")
def record():
    """record(cell: dict) appends one outcome to $OPTKIT_COMPAT_RESULTS, when set."""
    target = os.environ.get("OPTKIT_COMPAT_RESULTS")

    def write(cell: dict) -> None:
        if target:
            with open(target, "a") as f:
                f.write(json.dumps(cell, sort_keys=True) + "\n")

    return write
