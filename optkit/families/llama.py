"""Llama and the families that share its decoder layer names: Mistral, Qwen2, Qwen3.

How each reads config.json is transformers' config class's (LlamaConfig, MistralConfig, ...): its
defaults, and the keys that switch biases, q/k norms and sliding windows."""

from optkit.errors import OptkitError
from optkit.families import (
    LLAMA_GGUF_REQUIRED,
    ConfigReading,
    Family,
    GgufArchitecture,
    ModelType,
    register_family,
)


def attention_bias(config: dict) -> dict:
    """q/k/v and o_proj biases by `attention_bias` (LlamaConfig and the configs that copy it)."""
    bias = bool(config.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def every_layer_slides(config: dict) -> dict:
    """Mistral's window (Phi-3's where config.json sets one): every layer attends to the last
    `sliding_window` positions; a window at least the longest context never takes effect."""
    window = config.get("sliding_window")
    return {"sliding_window": window} if window is not None and window < config["max_position_embeddings"] else {}


def no_qwen_window(config: dict) -> dict:
    """Qwen2/3 slide only with use_sliding_window, on some layers: the runtime has no such window."""
    window = config.get("sliding_window", 4096) if config.get("use_sliding_window", False) else None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        sliding_layers = "sliding_attention" in layer_types
    else:
        sliding_layers = config["num_hidden_layers"] > config.get("max_window_layers", 28)
    max_positions = config["max_position_embeddings"]
    if sliding_layers and window is not None and window < max_positions:
        raise OptkitError(
            f"{config['model_type']} with sliding_window {window} (< max_position_embeddings {max_positions}): "
            "the runtime has no sliding-window attention for it; use a model with full attention"
        )
    return {}


def _llama(config: dict) -> dict:
    return {**attention_bias(config), "mlp_bias": bool(config.get("mlp_bias", False))}


def _qwen2(config: dict) -> dict:
    return {"qkv_bias": True, **no_qwen_window(config)}  # q/k/v always have a bias, o_proj none


def _qwen3(config: dict) -> dict:
    return {**attention_bias(config), "qk_norm": "head", **no_qwen_window(config)}  # RMSNorm per q/k head


LLAMA_READING = ConfigReading(defaults={"max_position_embeddings": 2048}, fields=_llama)
MISTRAL_READING = ConfigReading(
    defaults={"max_position_embeddings": 4096 * 32, "sliding_window": 4096}, fields=every_layer_slides
)
QWEN2_READING = ConfigReading(defaults={"max_position_embeddings": 32768}, fields=_qwen2)
QWEN3_READING = ConfigReading(defaults={"max_position_embeddings": 32768}, fields=_qwen3, head_dim=128)
LLAMA_GGUF = GgufArchitecture("llama", llama_rope=True)  # Mistral converts as Llama
QWEN3_GGUF = GgufArchitecture(
    "qwen3", attention_bias=False, required=(*LLAMA_GGUF_REQUIRED, "attn_q_norm", "attn_k_norm")
)

# Defined before it is registered: registering imports the other built-in families, and granite.py
# takes this layout from here while this module is still being imported.
LLAMA_LAYOUT = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    sequential_groups=(
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    ),
    smoothing_groups=(
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
        ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    runtime="optkit.models.llama:CausalLM",
    types={
        "llama": ModelType(LLAMA_READING, LLAMA_GGUF, "LlamaForCausalLM"),
        "mistral": ModelType(MISTRAL_READING, LLAMA_GGUF, "MistralForCausalLM"),
        "qwen2": ModelType(QWEN2_READING, GgufArchitecture("qwen2"), "Qwen2ForCausalLM"),
        "qwen3": ModelType(QWEN3_READING, QWEN3_GGUF, "Qwen3ForCausalLM"),
    },
)
LLAMA = register_family(LLAMA_LAYOUT)
