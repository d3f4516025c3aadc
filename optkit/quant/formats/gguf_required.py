"""What llama.cpp's loader requires of a .gguf of each architecture optkit writes (its family says:
`GgufArchitecture.required`, `required_keys`; families/), for `optkit verify` and `inspect`: the
keys it reads with no default and the block tensors it creates as required, with their shapes
(llama-model.cpp load_hparams and each model's load_arch_tensors, src/models/*.cpp)."""

from optkit.families import GgufArchitecture, gguf_architectures
from optkit.quant.formats.gguf_header import Header
from optkit.quant.formats.gguf_hparams import layer_values

# keys every written architecture's loader reads with no default ({arch} is general.architecture's value)
ARCH_KEYS = ("{arch}.feed_forward_length", "{arch}.attention.head_count", "{arch}.attention.layer_norm_rms_epsilon")


def written_as(header: Header) -> GgufArchitecture | None:
    """How optkit writes the file's architecture (None: one it does not write). llama is dense
    (Llama, Mistral) or a mixture of experts (Mixtral) as its expert_count says."""
    name = header.value("general.architecture")
    variants = [arch for arch in gguf_architectures().values() if arch.name == name]
    experts = bool(header.value(f"{name}.expert_count", 0)) if variants else False
    moe = [arch for arch in variants if ("ffn_gate_exps" in arch.required) == experts]
    return (moe or variants or [None])[0]


def arch_keys(arch: GgufArchitecture) -> tuple[str, ...]:
    return (*ARCH_KEYS, *(f"{{arch}}.{key}" for key in arch.required_keys))


def block_shapes(header: Header, arch: GgufArchitecture) -> list[dict[str, list[int]]]:
    """Per block: tensor name (after blk.N., without .weight) -> its shape in GGUF order, for a
    header whose metadata checks out."""
    name = arch.name
    width = header.value(f"{name}.embedding_length")
    heads = layer_values(header, f"{name}.attention.head_count")
    kv_heads = layer_values(header, f"{name}.attention.head_count_kv") or heads
    ffn = layer_values(header, f"{name}.feed_forward_length")
    k = header.value(f"{name}.attention.key_length", width // heads[0])
    v = header.value(f"{name}.attention.value_length", width // heads[0])
    experts = header.value(f"{name}.expert_count", 0)
    f_exp = header.value(f"{name}.expert_feed_forward_length", ffn[0])
    f_shared = header.value(f"{name}.expert_shared_feed_forward_length", ffn[0])
    blocks = []
    for q_heads, kv, f in zip(heads, kv_heads, ffn, strict=False):
        q, kv_k, kv_v = q_heads * k, kv * k, kv * v
        block = {
            "attn_norm": [width], "attn_q": [width, q], "attn_k": [width, kv_k], "attn_v": [width, kv_v],
            "attn_qkv": [width, q + kv_k + kv_v], "attn_output": [q_heads * v, width],
            "attn_q_norm": [q] if arch.full_qk_norm else [k], "attn_k_norm": [kv_k] if arch.full_qk_norm else [k],
            "post_attention_norm": [width], "ffn_norm": [width], "post_ffw_norm": [width],
            "ffn_gate": [width, f], "ffn_up": [width, 2 * f if "attn_qkv" in arch.required else f],
            "ffn_down": [f, width], "ffn_gate_inp": [width, experts],
            "ffn_gate_exps": [width, f_exp, experts], "ffn_up_exps": [width, f_exp, experts],
            "ffn_down_exps": [f_exp, width, experts], "ffn_gate_shexp": [width, f_shared],
            "ffn_up_shexp": [width, f_shared], "ffn_down_shexp": [f_shared, width],
        }  # fmt: skip
        blocks.append(block)
    return blocks
