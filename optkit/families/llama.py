"""Llama and the families that share its decoder layer names: Mistral, Qwen2, Qwen3."""

from optkit.families import Family, register_family

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
)
LLAMA = register_family(LLAMA_LAYOUT)
