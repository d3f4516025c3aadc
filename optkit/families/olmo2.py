"""AI2 OLMo 2: norms on each sublayer's output (post_attention_layernorm after the attention,
post_feedforward_layernorm after the MLP), none on its input, and RMSNorms over the whole q and k.

No norm feeds q/k/v or gate/up, so AWQ and SmoothQuant have nowhere to fold their scales for those
linears (post_attention_layernorm normalizes the attention's output, not the MLP's input); v → o and
up → down remain (v → o only where v's width equals o's input, without grouped-query attention).
"""

from optkit.families import LLAMA_GGUF_TENSORS, ConfigReading, Family, GgufArchitecture, ModelType, register_family
from optkit.families.llama import LLAMA_LAYOUT, attention_bias

_NO_NORM = "OLMo 2 has no norm on the sublayer's input to fold a scale into"


def _olmo2(config: dict) -> dict:
    """Norms after each sublayer (none before it), their weight multiplied in float32, and one
    RMSNorm over all of q's (k's) heads at once."""
    return {**attention_bias(config), "qk_norm": "full", "post_norms": True, "norm_weight_in_float32": True}


# gguf-py's TensorNameMap for OLMO2: the norms after each sublayer, q/k norms over all heads
OLMO2_GGUF_TENSORS = {
    **{name: gguf for name, gguf in LLAMA_GGUF_TENSORS.items() if "layernorm" not in name},
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
OLMO2_GGUF = GgufArchitecture(
    "olmo2",
    tensors=OLMO2_GGUF_TENSORS,
    required=tuple(OLMO2_GGUF_TENSORS.values()),
    output_required=True,  # llama_model_olmo2::load_arch_tensors: output.weight, no tied fallback
    full_qk_norm=True,
)
OLMO2 = register_family(
    Family(
        name="olmo2",
        model_types=("olmo2",),
        sequential_groups=LLAMA_LAYOUT.sequential_groups,  # the same linears, in the same order
        smoothing_groups=(
            ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
            ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
        ),
        unsmoothable=(
            (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), _NO_NORM),
            (("mlp.gate_proj", "mlp.up_proj"), _NO_NORM),
        ),
        runtime="optkit.models.llama:CausalLM",
        types={
            "olmo2": ModelType(
                ConfigReading(defaults={"max_position_embeddings": 2048}, fields=_olmo2),
                OLMO2_GGUF,
                vllm="Olmo2ForCausalLM",
            )
        },
    )
)
