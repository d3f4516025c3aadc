"""What llama.cpp's converter (convert_hf_to_gguf.py: TextModel, LlamaModel and each family's model
class) writes besides the tensors, for the families both support (each family names its llama.cpp
architecture and its own keys: `GgufArchitecture`, families/): the architecture's hyperparameters
and Llama's q/k row order, read from config.json. The vocabulary is gguf_vocab.py's, the tensors'
names and order gguf_plan.py's."""

import math

import torch

from optkit.errors import OptkitError
from optkit.families import GgufArchitecture, family_for, gguf_architectures


def language_model_config(config: dict) -> dict:
    """config.json as the runtime reads it (families/: ConfigReading): the language model's (Gemma 3's
    text_config) with its config class's defaults where a key is absent; such a view stays as it is."""
    model_type = config.get("model_type")
    reading = family_for(model_type).model_type(model_type).config
    multimodal = reading.language_model is not None and "text_config" in config
    view = reading.language_model(config) if multimodal else config
    return {**reading.defaults, **view}


def gguf_architecture(config: dict) -> GgufArchitecture:
    """What llama.cpp calls the model's type (its family says, families/), or one line refusing it
    (also where llama.cpp's graph for it cannot run what this config.json sets)."""
    model_type = config.get("model_type")
    arch = family_for(model_type).model_type(model_type).gguf
    if arch is not None and (problem := arch.problem(language_model_config(config))):
        raise OptkitError(f"--format gguf: {problem}: use --format compressed-tensors")
    if arch is None:
        raise OptkitError(
            f"--format gguf writes {', '.join(sorted(gguf_architectures()))} models, not {model_type!r}: "
            "use --format compressed-tensors"
        )
    if not arch.attention_bias and config.get("attention_bias"):
        raise OptkitError(
            f"--format gguf: llama.cpp's {arch.name.capitalize()} has no attention biases (this config sets "
            "attention_bias): use --format compressed-tensors"
        )
    return arch


def architecture(config: dict) -> str:
    """general.architecture of the model's GGUF file (Mistral converts as Llama)."""
    return gguf_architecture(config).name


def permute_qk(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Llama's q/k rows from Hugging Face's rotate-half order to GGML's interleaved RoPE order
    (LlamaModel.permute): per head, rows [r0..r_{h/2}, r_{h/2}..] -> pairs (r_i, r_{i+h/2}).
    rows: [heads·head_dim, ...] (weights, packed blocks or biases: rows move whole)."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).transpose(1, 2).reshape(shape)


def unpermute_qk(rows: torch.Tensor, heads: int) -> torch.Tensor:
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def qk_heads(config: dict, hf: str) -> int | None:
    """The head count Llama's permutation uses for this tensor, or None (no permutation)."""
    if not gguf_architecture(config).llama_rope:
        return None  # Qwen2/3 run NEOX RoPE in llama.cpp: Hugging Face's order as it is
    if ".self_attn.q_proj." in hf:
        return config["num_attention_heads"]
    if ".self_attn.k_proj." in hf:
        return config.get("num_key_value_heads") or config["num_attention_heads"]
    return None


def rope_parameters(config: dict) -> dict:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return {"rope_theta": config.get("rope_theta", 10000.0), **params}


def llama3_rope_factors(config: dict) -> torch.Tensor:
    """Llama 3.1's frequency divisors, one per rotary pair (llama.cpp reads them as `rope_freqs`):
    1 for short wavelengths, `factor` for long ones, smoothly in between."""
    p = rope_parameters(config)
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factor, low, high = p.get("factor", 8.0), p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_context = p.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    factors = torch.where(wavelen < old_context / high, 1.0, torch.where(wavelen > old_context / low, factor, mid))
    return factors.to(torch.float32)


def full_rope(config: dict) -> dict:
    """The RoPE of the full-attention layers (Gemma 3's sliding ones have their own base: its keys)."""
    model_type = config.get("model_type")
    reading = family_for(model_type).model_type(model_type).config
    view = language_model_config(config)
    return rope_parameters(reading.rope_sources(view)["rope_parameters"] if reading.rope_sources else view)


def rope_type(config: dict) -> str:
    """The RoPE scaling, or one line refusing one llama.cpp's graph for the model is not given."""
    rope = full_rope(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in gguf_architecture(config).rope_types:
        raise OptkitError(f"--format gguf: RoPE scaling {kind!r} is not written yet: use --format compressed-tensors")
    return kind


def add_hyperparameters(writer, config: dict) -> None:
    """TextModel.set_gguf_parameters and LlamaModel's additions, then the architecture's own keys
    (its family's `GgufArchitecture.keys`: Gemma2Model, Phi3MiniModel, GraniteModel, Qwen2MoeModel...)."""
    import gguf

    arch, kind = gguf_architecture(config), rope_type(config)
    family, rope = family_for(config.get("model_type")), full_rope(config)
    config = language_model_config(config)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_rope_freq_base(rope["rope_theta"])
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if family.moe is not None:
        experts, used, _ = family.moe.dims(config)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(used)
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch.llama_rope:  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(config["vocab_size"])
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        writer.add_rope_dimension_count(head_dim)
    for key, value in arch.keys(config).items():
        add_value(writer, f"{arch.name}.{key}", value)


def add_value(writer, key: str, value: object) -> None:
    """One metadata value in the type llama.cpp's loader reads it as."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))
