"""Tiny random models of each supported family, built from transformers' own config classes, for
the compatibility matrix and the family tests."""

import shutil
from pathlib import Path

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
GEMMA3_TEXT = dict(
    head_dim=32,
    sliding_window=16,
    query_pre_attn_scalar=32,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)
GEMMA3_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
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
    # Phi-3.5: fused qkv_proj / gate_up_proj, LongRoPE whose original context (64) the test prompts pass
    "phi3": dict(
        model_type="phi3",
        pad_token_id=None,
        eos_token_id=2,
        original_max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0 + 0.1 * i for i in range(16)],
            "long_factor": [1.0 + 2.0 * i for i in range(16)],
        },
    ),
    # Gemma: windows of 16 (< the 64-token calibration samples and the test prompts) on the sliding
    # layers, soft-caps that bind (scores ~±0.3 against 0.5, logits ~±0.6 against 1), Gemma 3's local
    # RoPE base; gemma3 is Gemma3ForConditionalGeneration (a SigLIP vision tower beside the same text)
    "gemma2": dict(
        model_type="gemma2",
        head_dim=32,
        sliding_window=16,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=0.5,
        final_logit_softcapping=1.0,
    ),
    "gemma3_text": dict(model_type="gemma3_text", **GEMMA3_TEXT),
    "gemma3": dict(model_type="gemma3", **GEMMA3_TEXT),
    # mixtures of experts: 4 experts, 2 per token; Qwen2-MoE with a shared expert and a dense layer
    # (mlp_only_layers), Qwen3-MoE with renormalized top-k weights
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=192,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        head_dim=32,
    ),
}


def save_tiny_family(name: str, out: Path, tokenizer_dir: Path, **overrides) -> Path:
    """A tiny random model of family `name` saved at `out`, its norms and biases perturbed so they
    count, with the tokenizer of `tokenizer_dir` (the reference vocabulary); `overrides` replace
    config keys (other sizes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    spec = {**FAMILIES[name], **overrides}
    model_type = spec.pop("model_type")
    if model_type == "gemma3":  # the text model inside Gemma3ForConditionalGeneration
        text = {**TINY, **spec, "model_type": "gemma3_text"}
        config = AutoConfig.for_model(model_type, text_config=text, vision_config=GEMMA3_VISION, mm_tokens_per_image=4)
    else:
        config = AutoConfig.for_model(model_type, **{**TINY, **spec})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if key.endswith("bias") or "norm" in key:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, out / file)
    return out
