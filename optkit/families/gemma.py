"""Google Gemma 2 and Gemma 3 (text, and the language model of the multimodal Gemma 3).

Each decoder layer has "sandwich" norms: input_layernorm → attention → post_attention_layernorm
(on the attention's output) → residual add, then pre_feedforward_layernorm → MLP →
post_feedforward_layernorm → residual add. So the norms that feed linears are input_layernorm
(q/k/v) and pre_feedforward_layernorm (gate/up); post_attention_layernorm feeds no linear (it
normalizes the attention's output before the residual add), unlike Llama's norm of that name.

The norms scale by (1 + w) (Gemma2RMSNorm, Gemma3RMSNorm), so a smoothing scale s folds into a norm
as (1 + w') = (1 + w)/s, i.e. w' = (1 + w)/s − 1 (`norm_weight_offset` 1).

The embeddings are multiplied by √hidden_size, rounded to the model's dtype first (as transformers'
Gemma*TextScaledWordEmbedding does with its embed_scale buffer).

Gemma 3 of 4B and up ships as `gemma3` (Gemma3ForConditionalGeneration): its checkpoint holds the
language model under language_model.model.* and a SigLIP vision tower with its projector. optkit
quantizes and serves the language model only; the vision tower and projector are copied into the
artifact in full precision and the runtime leaves them out (text in, text out).
"""

from optkit.errors import OptkitError
from optkit.families import (
    GGUF_ATTENTION,
    LLAMA_GGUF_TENSORS,
    ConfigReading,
    Family,
    GgufArchitecture,
    ModelType,
    register_family,
)
from optkit.families.llama import LLAMA_LAYOUT, attention_bias

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


def embedding_scale(config) -> float:
    """√hidden_size rounded to the checkpoint's dtype, as transformers multiplies the embeddings."""
    import torch  # here, not at the top: the registry is read without torch (quant/supported.py)

    config = getattr(config, "text_config", None) or config
    dtype = getattr(config, "dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype or "float32"), torch.float32)
    return torch.tensor(config.hidden_size**0.5, dtype=dtype).item()


SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' config defaults for the keys a config.json may leave out (Gemma2Config, Gemma3TextConfig)
_SHARED_DEFAULTS = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)
GEMMA2_DEFAULTS = dict(
    _SHARED_DEFAULTS,
    vocab_size=256000,
    max_position_embeddings=8192,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
)
GEMMA3_DEFAULTS = dict(_SHARED_DEFAULTS, vocab_size=262208, max_position_embeddings=131072)


def _layer_types(config: dict) -> tuple[str, ...]:
    layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None:  # as the config classes derive them
        pattern = 2 if config["model_type"] == "gemma2" else config.get("sliding_window_pattern", 6)
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if len(layer_types) != layers or set(layer_types) - {SLIDING, FULL}:
        raise OptkitError(f"layer_types {layer_types} does not name {layers} sliding/full layers: fix config.json")
    return tuple(layer_types)


def _gemma_fields(config: dict) -> dict:
    """The runtime's fields of Gemma 2 and 3 (their modeling files in transformers): norms that scale
    by (1 + weight) in float32, sandwich norms, √hidden_size rounded to the model dtype, GeGLU-tanh,
    the soft-caps, the sliding layers."""
    model_type = config["model_type"]
    if config.get("use_bidirectional_attention"):
        raise OptkitError(f"{model_type} with use_bidirectional_attention: the runtime runs causal language models")
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise OptkitError(f"hidden_activation {act!r} is not supported: the runtime runs Gemma with gelu_pytorch_tanh")
    layer_types = _layer_types(config)
    window = config.get("sliding_window")
    return dict(
        attention_bias(config),
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
        layer_types=layer_types,
        qk_norm=None if model_type == "gemma2" else "head",
    )


def _gemma3_rope(config: dict) -> dict[str, dict]:
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
    return {"rope_parameters": full, "local_rope_parameters": local}


def _language_model(config: dict) -> dict:
    """Gemma3ForConditionalGeneration's config.json: the runtime runs its language model."""
    text = config.get("text_config") or {}
    eos = config.get("eos_token_id", text.get("eos_token_id", 1))
    return {**text, "model_type": "gemma3", "eos_token_id": eos}


# gguf-py's TensorNameMap for GEMMA2/GEMMA3: the sandwich norms have names of their own
GEMMA_GGUF_TENSORS = {
    **LLAMA_GGUF_TENSORS,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GEMMA_REQUIRED = (
    *GGUF_ATTENTION,
    "post_attention_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "post_ffw_norm",
)
# llama.cpp's default sliding-window pattern (llama_model_gemma2/3::load_arch_hparams) and the layer
# count of the 27B models, whose queries llama.cpp scales by 1/√(hidden / heads), not 1/√head_dim
_LLAMA_CPP_PATTERN = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def _gguf_arch(config: dict) -> str:
    return "gemma2" if config["model_type"] == "gemma2" else "gemma3"


def _gguf_keys(config: dict) -> dict:
    """Gemma2Model/Gemma3Model.set_gguf_parameters: the soft-caps the model applies, the window, the
    local RoPE base (TextModel's rope.freq_base_swa) and, where the layers do not follow llama.cpp's
    default pattern, which layers slide (as Olmo2Model writes sliding_window_pattern)."""
    fields, arch = _gemma_fields(config), _gguf_arch(config)
    keys = {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if fields[name] is not None:
            keys[name] = float(fields[name])
    if fields["sliding_window"] is not None:
        keys["attention.sliding_window"] = int(fields["sliding_window"])
        pattern = [kind == SLIDING for kind in fields["layer_types"]]
        default = [(i + 1) % _LLAMA_CPP_PATTERN[arch] != 0 for i in range(len(pattern))]
        if pattern != default:
            keys["attention.sliding_window_pattern"] = pattern
    if arch == "gemma3":
        local = _gemma3_rope(config)["local_rope_parameters"]
        keys["rope.freq_base_swa"] = float(local.get("rope_theta") or local["rope_parameters"]["rope_theta"])
    return keys


def _gguf_problem(config: dict) -> str | None:
    """What llama.cpp's Gemma graphs fix that a config.json may set otherwise."""
    arch, heads = _gguf_arch(config), config["num_attention_heads"]
    width = config["hidden_size"] // heads if config["num_hidden_layers"] == _LAYERS_27B[arch] else config["head_dim"]
    if config["query_pre_attn_scalar"] != width:
        return (
            f"query_pre_attn_scalar {config['query_pre_attn_scalar']}: llama.cpp's {arch} scales queries by 1/√{width}"
        )
    if arch == "gemma2" and config.get("attn_logit_softcapping") is None:
        return "attn_logit_softcapping null: llama.cpp's gemma2 always soft-caps attention scores"
    return None


def _gemma_gguf(name: str, required: tuple[str, ...]) -> GgufArchitecture:
    return GgufArchitecture(
        name, tensors=GEMMA_GGUF_TENSORS, required=required, norm_offset=1.0, keys=_gguf_keys, problem=_gguf_problem
    )


GEMMA2_GGUF = _gemma_gguf("gemma2", _GEMMA_REQUIRED)
GEMMA3_GGUF = _gemma_gguf("gemma3", (*_GEMMA_REQUIRED, "attn_q_norm", "attn_k_norm"))
GEMMA2_READING = ConfigReading(defaults=GEMMA2_DEFAULTS, fields=_gemma_fields)
GEMMA3_READING = ConfigReading(defaults=GEMMA3_DEFAULTS, fields=_gemma_fields, rope_sources=_gemma3_rope)
GEMMA_LAYOUT = Family(
    name="gemma2",
    model_types=("gemma2",),
    sequential_groups=LLAMA_LAYOUT.sequential_groups,  # the same linears, in the same order
    smoothing_groups=(
        ("input_layernorm", _QKV, "self_attn"),
        ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        ("pre_feedforward_layernorm", _GATE_UP, "mlp"),
        ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    runtime="optkit.models.llama:CausalLM",
    embedding_scale=embedding_scale,
    norm_weight_offset=1.0,
    types={"gemma2": ModelType(GEMMA2_READING, GEMMA2_GGUF, vllm="Gemma2ForCausalLM")},
)
GEMMA2 = register_family(GEMMA_LAYOUT)
GEMMA3 = register_family(
    Family(
        **{
            **GEMMA_LAYOUT.__dict__,
            "name": "gemma3",
            "model_types": ("gemma3_text",),
            "types": {"gemma3_text": ModelType(GEMMA3_READING, GEMMA3_GGUF, vllm="Gemma3ForCausalLM")},
        }
    ),
)
GEMMA3_MULTIMODAL = register_family(
    Family(
        **{
            **GEMMA_LAYOUT.__dict__,
            "name": "gemma3-multimodal",
            "model_types": ("gemma3",),
            # transformers' modules are model.language_model.*, the checkpoint's language_model.model.*
            "checkpoint_renames": ((".language_model.model.", ".model.language_model."),),
            "runtime_renames": (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
            "outside_runtime": (
                ("vision_tower.", "multi_modal_projector."),
                "the vision tower and its projector stay in full precision in the artifact; "
                "the optkit runtime serves the language model (text only)",
            ),
            "types": {
                "gemma3": ModelType(
                    ConfigReading(**{**GEMMA3_READING.__dict__, "language_model": _language_model}),
                    GEMMA3_GGUF,
                    vllm="Gemma3ForConditionalGeneration",
                )
            },
        }
    ),
)
