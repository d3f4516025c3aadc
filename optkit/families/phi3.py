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

from optkit.families import ConfigReading, Family, ModelType, register_family
from optkit.families.llama import every_layer_slides

_FUSED = "its input comes from the {} rows of the fused {}, which take no scale of their own"

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
                vllm="Phi3ForCausalLM",
            )
        },
    )
)
