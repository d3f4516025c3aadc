"""The runtime's model configuration, read from a Hugging Face config.json dict.

What every family shares is read here (the sizes, norms' epsilon, tied embeddings, EOS tokens,
RoPE: models/rope.py); what a model_type means beyond that (its config class's defaults, biases,
q/k norms, multipliers, soft-caps, sliding windows) its family says (`ConfigReading`, families/).
The mixture-of-experts fields come from the family's MoE layout (models/moe.py).
"""

from dataclasses import dataclass, field

import torch

from optkit.errors import OptkitError
from optkit.families import ConfigReading, family_for, model_types
from optkit.hf_config import MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, check_config
from optkit.models.moe import MoEConfig, moe_config
from optkit.models.rope import DEFAULT_THETA, rope_frequencies, standardize_rope

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
        runtime_types = model_types(runtime=True)
        if model_type not in runtime_types:
            raise OptkitError(
                f"model_type {model_type!r} is not supported by the runtime: it runs {', '.join(runtime_types)}"
            )
        family = family_for(model_type)
        reading = family.model_type(model_type).config
        if reading.language_model is not None:
            config = reading.language_model(config)
        config = {**reading.defaults, **config}
        missing = [key for key in _REQUIRED if config.get(key) is None]  # JSON null says no more than absent
        if missing:
            raise OptkitError(f"config.json lacks {', '.join(missing)}: re-save the model with save_pretrained")
        try:
            moe = moe_config(family.moe, config) if family.moe is not None else None
        except KeyError as e:
            raise OptkitError(f"config.json lacks {e.args[0]}, which {model_type} needs: fix config.json") from e
        if "max_position_embeddings" not in config:
            raise OptkitError(
                f"config.json lacks max_position_embeddings and family {family.name} gives {model_type} no "
                "default: add max_position_embeddings to config.json"
            )
        fields = {**_shared_fields(config, reading, generation_config), "moe": moe, **reading.fields(config)}
        if "hidden_act" not in fields and config.get("hidden_act", "silu") != "silu":
            raise OptkitError(f"hidden_act {config['hidden_act']!r} is not supported: the runtime runs silu MLPs")
        sources = reading.rope_sources(config) if reading.rope_sources else {"rope_parameters": config}
        for name, source in sources.items():
            fields[name] = standardize_rope(source, config["max_position_embeddings"], reading.rope_type_aliases)
        return cls(**fields)

    def scale_embeddings(self, h: torch.Tensor) -> torch.Tensor:
        """embed_tokens' rows [..., hidden] -> what the first decoder layer receives."""
        if self.round_embedding_multiplier:  # Gemma: √hidden rounded to the model dtype first
            return h * torch.tensor(self.embedding_multiplier, dtype=h.dtype)
        if self.embedding_multiplier != 1.0:  # Granite
            return h * self.embedding_multiplier
        return h

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


def _shared_fields(config: dict, reading: ConfigReading, generation_config: dict | None) -> dict:
    """The fields every family reads alike from config.json (with its family's defaults)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or reading.head_dim
    if not head_dim:
        if config["hidden_size"] % heads:
            raise OptkitError(
                f"config.json: hidden_size {config['hidden_size']} is not a multiple of num_attention_heads {heads} "
                "and there is no head_dim: fix config.json"
            )
        head_dim = config["hidden_size"] // heads
    return dict(
        model_type=config["model_type"],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config.get("rms_norm_eps", _DEFAULT_RMS_EPS),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config["max_position_embeddings"],
        eos_token_ids=_eos_token_ids(config, generation_config or {}),
    )


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
