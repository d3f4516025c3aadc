"""AI2 OLMo 2: norms on each sublayer's output (post_attention_layernorm after the attention,
post_feedforward_layernorm after the MLP), none on its input, and RMSNorms over the whole q and k.

No norm feeds q/k/v or gate/up, so AWQ and SmoothQuant have nowhere to fold their scales for those
linears (post_attention_layernorm normalizes the attention's output, not the MLP's input); v → o and
up → down remain (v → o only where v's width equals o's input, without grouped-query attention).
"""

from optkit.families import Family, register_family
from optkit.families.llama import LLAMA_LAYOUT

_NO_NORM = "OLMo 2 has no norm on the sublayer's input to fold a scale into"

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
    )
)
