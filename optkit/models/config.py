"""The runtime's model configuration, read from a Hugging Face config.json dict.

Supported: model_type llama, mistral, qwen2, qwen3 (qwen3 adds an RMSNorm on each query and key
head), granite (Llama with embedding, residual, attention and logit multipliers), olmo2 (norms on
each sublayer's output instead of its input, RMSNorms over the whole q and k), phi3 (fused qkv_proj
and gate_up_proj, LongRoPE, partial rotary factor: models/phi3.py), gemma2 and gemma3 (soft-caps,
sliding windows), and the mixture-of-experts families (models/moe.py). RoPE: models/rope.py.
"""

from dataclasses import dataclass, field

import torch

from optkit.errors import OptkitError
from optkit.families import model_types
from optkit.hf_config import MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, check_config
from optkit.models.moe import DENSE_TWINS, MoEConfig, dense_twin, moe_fields
from optkit.models.rope import DEFAULT_THETA, rope_frequencies, standardize_rope

MODEL_TYPES = model_types(runtime=True)  # the families of families/ that this runtime runs
# transformers' defaults, for keys a config.json may leave out
_DEFAULT_MAX_POSITIONS = {
    "llama": 2048,
    "mistral": 4096 * 32,
    "qwen2": 32768,
    "qwen3": 32768,
    "granite": 2048,
    "olmo2": 2048,
    "phi3": 4096,
    "gemma2": 8192,
    "gemma3_text": 131072,
}
# Gemma: transformers' config defaults for the keys a config.json may leave out (Gemma2Config, Gemma3TextConfig)
_GEMMA_DEFAULTS = {
    "gemma2": dict(
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        tie_word_embeddings=True,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "gemma3_text": dict(
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        tie_word_embeddings=True,
        query_pre_attn_scalar=256,
        sliding_window=4096,
    ),
}
SLIDING, FULL = "sliding_attention", "full_attention"
_DEFAULT_RMS_EPS = 1e-6
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False  # q/k/v projections have a bias (qwen2; llama/qwen3 with attention_bias)
    o_bias: bool = False  # o_proj has a bias (llama/qwen3 with attention_bias)
    mlp_bias: bool = False  # gate/up/down have a bias (llama with mlp_bias)
    # RMSNorm on q and k before RoPE: "head" over each head (qwen3), "full" over all heads at once (olmo2)
    qk_norm: str | None = None
    post_norms: bool = False  # norms on each sublayer's output before the residual add, none on its input (olmo2)
    norm_weight_in_float32: bool = False  # the norm weight multiplies before the cast back (olmo2)
    # granite: h = embed·embedding_multiplier; h += sublayer·residual_multiplier; logits / logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # the attention scale; None: 1/√head_dim
    logits_scaling: float = 1.0
    # Gemma: norms scale by (1 + weight), in float32; sandwich norms (input_layernorm and a norm on the
    # attention's output, pre_ and post_feedforward_layernorm); the embedding multiplier rounded to the
    # model dtype first; GELU-tanh MLP; tanh soft-capping of attention scores and of the final logits
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    round_embedding_multiplier: bool = False
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # sliding-window attention: layer i attends to the last `sliding_window` positions (its own
    # included) when layer_types[i] is "sliding_attention"; () means every layer is full attention
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # RoPE of the sliding layers where it differs from the full ones (Gemma 3's local base)
    local_rope_parameters: dict | None = None
    moe: MoEConfig | None = None  # mixtral, qwen2_moe, qwen3_moe: the experts (models/moe.py)
    eos_token_ids: list[int] = field(default_factory=list)
    # standardized as transformers does: always rope_type and rope_theta, plus the type's own keys
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": DEFAULT_THETA})

    def __post_init__(self):
        check_dimensions(self)

    @classmethod
    def from_hf(cls, config: dict, generation_config: dict | None = None) -> "ModelConfig":
        """From config.json (and, optionally, generation_config.json, which may add EOS tokens)."""
        config = check_config(config, "config.json")  # a dict whose sizes are usable, before any is read
        model_type = config.get("model_type")
        if model_type == "gemma3":  # Gemma3ForConditionalGeneration: the runtime runs its language model
            text = config.get("text_config") or {}
            eos = config.get("eos_token_id", text.get("eos_token_id", 1))
            config = {**text, "model_type": "gemma3", "eos_token_id": eos}
        if model_type in _GEMMA_DEFAULTS or model_type == "gemma3":
            config = {**_GEMMA_DEFAULTS["gemma2" if model_type == "gemma2" else "gemma3_text"], **config}
        missing = [key for key in _REQUIRED if config.get(key) is None]  # JSON null says no more than absent
        if missing and model_type in MODEL_TYPES:
            raise OptkitError(f"config.json lacks {', '.join(missing)}: re-save the model with save_pretrained")
        if model_type in DENSE_TWINS and model_type in MODEL_TYPES:  # the dense twin's fields, and the experts
            try:
                experts = moe_fields(config)
            except KeyError as e:
                raise OptkitError(f"config.json lacks {e.args[0]}, which {model_type} needs: fix config.json") from e
            return cls(**{**vars(cls.from_hf(dense_twin(config), generation_config)), **experts})
        if model_type not in MODEL_TYPES:
            raise OptkitError(
                f"model_type {model_type!r} is not supported by the runtime: it runs {', '.join(MODEL_TYPES)}"
            )
        gemma = _gemma_fields(config, model_type) if model_type in ("gemma2", "gemma3_text", "gemma3") else {}
        if not gemma and config.get("hidden_act", "silu") != "silu":
            raise OptkitError(f"hidden_act {config['hidden_act']!r} is not supported: the runtime runs silu MLPs")
        sliding = {} if gemma else _sliding_window(config, model_type)
        heads = config["num_attention_heads"]
        if model_type != "qwen3" and not config.get("head_dim") and config["hidden_size"] % heads:
            raise OptkitError(
                f"config.json: hidden_size {config['hidden_size']} is not a multiple of num_attention_heads {heads} "
                "and there is no head_dim: fix config.json"
            )
        default_head_dim = 128 if model_type == "qwen3" else config["hidden_size"] // heads
        max_positions = config.get(
            "max_position_embeddings", _DEFAULT_MAX_POSITIONS["gemma3_text" if model_type == "gemma3" else model_type]
        )
        attention_bias = bool(config.get("attention_bias", False))
        granite = model_type == "granite"
        fields = dict(
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or default_head_dim,
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=config.get("rms_norm_eps", _DEFAULT_RMS_EPS),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
            qkv_bias=model_type == "qwen2" or (model_type in _ATTENTION_BIAS and attention_bias),
            o_bias=model_type in _ATTENTION_BIAS and attention_bias,
            mlp_bias=model_type in ("llama", "granite") and bool(config.get("mlp_bias", False)),
            qk_norm={"qwen3": "head", "olmo2": "full", "gemma3_text": "head", "gemma3": "head"}.get(model_type),
            post_norms=model_type == "olmo2",
            norm_weight_in_float32=model_type == "olmo2",
            embedding_multiplier=_number(config, "embedding_multiplier") if granite else 1.0,
            residual_multiplier=_number(config, "residual_multiplier") if granite else 1.0,
            attention_multiplier=_number(config, "attention_multiplier") if granite else None,
            logits_scaling=_number(config, "logits_scaling") if granite else 1.0,
            eos_token_ids=_eos_token_ids(config, generation_config or {}),
        )
        fields.update(sliding)
        fields.update(gemma)
        if gemma and model_type != "gemma2":
            fields.update(_gemma_rope(config, max_positions))
        else:
            fields["rope_parameters"] = standardize_rope(config, max_positions)
        return cls(**fields)

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that RoPE rotates (all but with partial_rotary_factor)."""
        return int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))

    def rope_frequencies(self, context_len: int | None = None) -> tuple[torch.Tensor, float]:
        """(inv_freq float32 [rotary_dim / 2] on the CPU, attention scaling of cos and sin), for
        sequences of up to `context_len` tokens (default max_position_embeddings; LongRoPE's factors
        depend on it)."""
        context_len = context_len or self.max_position_embeddings
        return rope_frequencies(self.rope_parameters, self.rotary_dim, self.max_position_embeddings, context_len)

    def local_rope_frequencies(self) -> tuple[torch.Tensor, float]:
        """rope_frequencies of the sliding layers (Gemma 3's local base; the same elsewhere)."""
        if self.local_rope_parameters is None:
            return self.rope_frequencies()
        return rope_frequencies(self.local_rope_parameters, self.rotary_dim, self.max_position_embeddings)

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends to every position before it)."""
        if self.sliding_window is None:
            return None
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def all_layers_slide(self) -> bool:
        """Every layer has a window: KV blocks that leave it are never read again (docs/runtime.md)."""
        return all(self.window(i) is not None for i in range(self.num_hidden_layers))


def _number(config: dict, key: str, default: float = 1.0) -> float:
    """A multiplier of config.json (hf_config checked it is finite), its default when absent or null."""
    value = config.get(key)
    return default if value is None else float(value)


_ATTENTION_BIAS = ("llama", "qwen3", "granite", "olmo2", "gemma2", "gemma3_text", "gemma3")


def _gemma_fields(config: dict, model_type: str) -> dict:
    """The ModelConfig fields of Gemma 2 and 3 (their modeling files in transformers)."""
    if config.get("use_bidirectional_attention"):
        raise OptkitError(f"{model_type} with use_bidirectional_attention: the runtime runs causal language models")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise OptkitError(f"hidden_activation {act!r} is not supported: the runtime runs Gemma with gelu_pytorch_tanh")
    layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None:  # as the config classes derive them
        pattern = 2 if model_type == "gemma2" else config.get("sliding_window_pattern", 6)
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if len(layer_types) != layers or set(layer_types) - {SLIDING, FULL}:
        raise OptkitError(f"layer_types {layer_types} does not name {layers} sliding/full layers: fix config.json")
    window = config.get("sliding_window")
    return dict(
        norm_weight_offset=1.0,
        sandwich_norms=True,
        norm_weight_in_float32=True,
        embedding_multiplier=config["hidden_size"] ** 0.5,
        round_embedding_multiplier=True,
        attention_multiplier=config["query_pre_attn_scalar"] ** -0.5,
        hidden_act="gelu_pytorch_tanh",
        # Gemma 3's attention in transformers passes no softcap: its attn_logit_softcapping is unused
        attn_logit_softcapping=config.get("attn_logit_softcapping") if model_type == "gemma2" else None,
        # Gemma3ForConditionalGeneration's head applies no final soft-cap (Gemma3ForCausalLM's does)
        final_logit_softcapping=config.get("final_logit_softcapping") if model_type != "gemma3" else None,
        sliding_window=window if window and SLIDING in layer_types else None,
        layer_types=tuple(layer_types),
    )


def _gemma_rope(config: dict, max_positions: int) -> dict:
    """Gemma 3 rotates its sliding layers with a local base (rope_local_base_freq, or transformers 5's
    rope_parameters per layer type); `rope_scaling` applies to the full layers only."""
    rope = config.get("rope_parameters") or {}
    if FULL in rope or SLIDING in rope:
        full, local = (
            {"rope_parameters": dict(rope.get(FULL) or {})},
            {"rope_parameters": dict(rope.get(SLIDING) or {})},
        )
        full["rope_parameters"].setdefault("rope_theta", 1_000_000.0)
        local["rope_parameters"].setdefault("rope_theta", 10_000.0)
    else:
        full = {"rope_scaling": config.get("rope_scaling"), "rope_parameters": rope or None}
        full["rope_theta"] = config.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    return {
        "rope_parameters": standardize_rope(full, max_positions),
        "local_rope_parameters": standardize_rope(local, max_positions),
    }


def _sliding_window(config: dict, model_type: str) -> dict:
    """Mistral's window (every layer slides); refuse the windows of the others (not implemented)."""
    max_positions = config.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type])
    if model_type in ("mistral", "phi3"):  # every layer slides (Phi3Config: only where config.json sets a window)
        window = config.get("sliding_window", 4096 if model_type == "mistral" else None)
        return {"sliding_window": window} if window is not None and window < max_positions else {}
    if model_type in ("qwen2", "qwen3"):  # a window only with use_sliding_window, on some layers
        window = config.get("sliding_window", 4096) if config.get("use_sliding_window", False) else None
        layer_types = config.get("layer_types")
        if layer_types is not None:
            sliding_layers = "sliding_attention" in layer_types
        else:
            sliding_layers = config["num_hidden_layers"] > config.get("max_window_layers", 28)
        window = window if sliding_layers else None
    else:
        window = None
    if window is not None and window < max_positions:
        raise OptkitError(
            f"{model_type} with sliding_window {window} (< max_position_embeddings {max_positions}): "
            "the runtime has no sliding-window attention for it; use a model with full attention"
        )
    return {}


def _eos_token_ids(config: dict, generation_config: dict) -> list[int]:
    ids: list[int] = []
    for source in (config, generation_config):
        value = source.get("eos_token_id")
        for token in [value] if isinstance(value, int) else value or []:
            if token not in ids:
                ids.append(token)
    return ids


def check_dimensions(config: ModelConfig) -> None:
    """Every size the runtime builds a tensor or divides by is a usable whole number (config.json
    may say anything: hf_config.py checks its keys; this checks what the family's defaults made of them)."""
    limits = dict.fromkeys(_DIMENSIONS, MAX_WIDTH) | {"vocab_size": MAX_VOCAB, "max_position_embeddings": MAX_POSITIONS}
    for name, limit in limits.items():
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise OptkitError(f"config.json: {name} {value!r} is not a whole number from 1 to {limit}: fix config.json")
    if config.num_attention_heads % config.num_key_value_heads:
        raise OptkitError(
            f"num_attention_heads {config.num_attention_heads} is not a multiple of num_key_value_heads "
            f"{config.num_key_value_heads}: fix config.json"
        )
    rotary = config.rotary_dim
    if rotary < 2 or rotary % 2:
        raise OptkitError(
            f"config.json: head_dim {config.head_dim} rotates {rotary} dimensions: RoPE needs an even number "
            "of at least 2; fix head_dim or partial_rotary_factor"
        )
    if config.layer_types and len(config.layer_types) != config.num_hidden_layers:
        raise OptkitError(
            f"config.json: layer_types names {len(config.layer_types)} layers, num_hidden_layers "
            f"{config.num_hidden_layers}: fix config.json"
        )
    window = config.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise OptkitError(f"config.json: sliding_window {window!r} is not a positive whole number: fix config.json")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in config.eos_token_ids):
        raise OptkitError(f"EOS token ids {config.eos_token_ids!r} are not token ids: fix eos_token_id")
    moe = config.moe
    if moe is not None and not (
        all(isinstance(n, int) and not isinstance(n, bool) for n in (moe.top_k, moe.num_experts, moe.intermediate_size))
        and 1 <= moe.top_k <= moe.num_experts
        and moe.intermediate_size >= 1
        and all(0 <= i < config.num_hidden_layers for i in moe.sparse_layers)
    ):
        raise OptkitError(
            f"config.json: {moe.num_experts} experts, {moe.top_k} per token, intermediate size "
            f"{moe.intermediate_size}: give at least one expert per token, no more than there are; fix config.json"
        )


# the sizes the runtime allocates by (vocab and positions have their own bounds)
_DIMENSIONS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)
