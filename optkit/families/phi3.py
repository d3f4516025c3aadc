"""Microsoft Phi-3, Phi-3.5 and Phi-4 mini (model_type `phi3`): Llama's decoder with q, k and v in
one fused linear (`self_attn.qkv_proj`, rows [q | k | v]) and gate and up in another
(`mlp.gate_up_proj`, rows [gate | up]), LongRoPE scaling, and Phi-4 mini's partial rotary factor.

The fused linears are quantized as they are stored (one weight, one set of scales), as transformers
and vLLM load them. The norms fold AWQ's and SmoothQuant's scales into qkv_proj and gate_up_proj.
v → o and up → down are left unsmoothed: the scale of o_proj's (down_proj's) inputs would divide
only the v (up) rows of the fused linear, and the family description folds a scale into a module's
whole output (fold_scale); without grouped-query attention the v rows and o's inputs would match,
with it (Phi-3 medium, Phi-4 mini) they do not.
"""

import math

from optkit.families import ConfigReading, Family, GgufArchitecture, ModelType, register_family
from optkit.families.llama import every_layer_slides

_FUSED = "its input comes from the {} rows of the fused {}, which take no scale of their own"


def _rope(config: dict) -> dict:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    for key in ("original_max_position_embeddings", "partial_rotary_factor"):
        if key in config:
            rope.setdefault(key, config[key])
    return rope


def _rope_dims(config: dict) -> int:
    factor = _rope(config).get("partial_rotary_factor", 1.0)
    return int(factor * config["hidden_size"]) // config["num_attention_heads"]


def _gguf_keys(config: dict) -> dict:
    """Phi3MiniModel.set_gguf_parameters and generate_extra_tensors' attention factor: the rotary
    width, LongRoPE's original context and √(1 + ln(scale) / ln(original)) (transformers' own when
    the config gives one), and the window (0: none)."""
    rope = _rope(config)
    keys = {"rope.dimension_count": _rope_dims(config), "attention.sliding_window": config.get("sliding_window") or 0}
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su"):
        original = rope.get("original_max_position_embeddings", config["max_position_embeddings"])
        scale = config["max_position_embeddings"] / original
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        keys["rope.scaling.type"] = "longrope"
        keys["rope.scaling.original_context_length"] = int(original)
        keys["rope.scaling.attn_factor"] = float(rope.get("attention_factor") or factor)
    return keys


def _gguf_tensors(config: dict) -> dict:
    """rope_factors_long/short.weight: LongRoPE's per-pair divisors."""
    rope = _rope(config)
    if not rope.get("long_factor"):
        return {}
    return {"rope_factors_long.weight": rope["long_factor"], "rope_factors_short.weight": rope["short_factor"]}


def _gguf_problem(config: dict) -> str | None:
    rope = _rope(config)
    if rope.get("long_factor") and len(rope["long_factor"]) * 2 != _rope_dims(config):
        return f"LongRoPE factors ({len(rope['long_factor'])}) are not half the rotary width {_rope_dims(config)}"
    if every_layer_slides(config):
        return f"sliding_window {config['sliding_window']}: llama.cpp's phi3 runs without its window"
    return None


# Phi3MiniModel: the fused linears keep their names' places (attn_qkv; gate_up as ffn_up, [gate | up])
PHI3_GGUF_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
PHI3_GGUF = GgufArchitecture(
    "phi3",
    tensors=PHI3_GGUF_TENSORS,
    required=tuple(PHI3_GGUF_TENSORS.values()),
    keys=_gguf_keys,
    problem=_gguf_problem,
    rope_types=("default", "longrope", "su"),
    extra_tensors=_gguf_tensors,
)
PHI3 = register_family(
    Family(
        name="phi3",
        model_types=("phi3",),
        sequential_groups=(
            ("self_attn.qkv_proj",),
            ("self_attn.o_proj",),
            ("mlp.gate_up_proj",),
            ("mlp.down_proj",),
        ),
        smoothing_groups=(
            ("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
            ("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
        ),
        unsmoothable=(
            (("self_attn.o_proj",), _FUSED.format("v", "qkv_proj")),
            (("mlp.down_proj",), _FUSED.format("up", "gate_up_proj")),
        ),
        runtime="optkit.models.phi3:CausalLM",
        types={
            "phi3": ModelType(
                ConfigReading(
                    defaults={"max_position_embeddings": 4096},
                    fields=every_layer_slides,  # only where config.json sets a window (Phi3Config)
                    rope_type_aliases={"su": "longrope", "yarn": "longrope"},  # Phi3Config's reading of old configs
                ),
                PHI3_GGUF,
                vllm="Phi3ForCausalLM",
            )
        },
    )
)
