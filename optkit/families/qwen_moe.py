"""Qwen2-MoE and Qwen3-MoE: Qwen2's (q/k/v bias) or Qwen3's (q/k norms) attention, and in each
sparse layer a router (`mlp.gate`) choosing `num_experts_per_tok` of `num_experts` SwiGLU experts
(`mlp.experts.N.gate_proj/up_proj/down_proj`), their softmax weights renormalized only with
`norm_topk_prob`. Qwen2-MoE adds a shared expert every token goes through, scaled by
sigmoid(`shared_expert_gate`). Layers in `mlp_only_layers` or off `decoder_sparse_step` keep a
dense MLP (`mlp.gate_proj/up_proj/down_proj`), quantized and smoothed as Llama's.
"""

from dataclasses import replace

from optkit.families import (
    GGUF_ATTENTION,
    GGUF_EXPERTS,
    LLAMA_GGUF_TENSORS,
    Family,
    GgufArchitecture,
    ModelType,
    MoELayout,
    register_family,
)
from optkit.families.llama import LLAMA_LAYOUT, QWEN2_READING, QWEN3_READING
from optkit.families.mixtral import ROUTED_NORM


def _is_sparse(config: dict, index: int) -> bool:
    step = config.get("decoder_sparse_step", 1)
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    return index not in (config.get("mlp_only_layers") or []) and experts > 0 and (index + 1) % step == 0


def _qwen2_moe(config: dict) -> dict:
    """Qwen2's fields, but the q/k/v biases follow `qkv_bias` (Qwen2MoeConfig; Qwen2 always has them)."""
    return {**QWEN2_READING.fields(config), "qkv_bias": bool(config.get("qkv_bias", True))}


def _gguf_keys(config: dict) -> dict:
    """Qwen2MoeModel.set_gguf_parameters: the experts' widths."""
    keys = {"expert_feed_forward_length": config["moe_intermediate_size"]}
    if config.get("shared_expert_intermediate_size") is not None:
        keys["expert_shared_feed_forward_length"] = config["shared_expert_intermediate_size"]
    return keys


def _gguf_problem(config: dict, renormalizes: bool) -> str | None:
    """llama.cpp's qwen2moe/qwen3moe graphs: every layer sparse, top-k weights renormalized by Qwen3's only."""
    dense = [i for i in range(config["num_hidden_layers"]) if not _is_sparse(config, i)]
    if dense:
        return f"layers {dense} have a dense MLP (mlp_only_layers, decoder_sparse_step): llama.cpp's graph has none"
    if bool(config.get("norm_topk_prob", False)) != renormalizes:
        return f"norm_topk_prob {config.get('norm_topk_prob', False)}: llama.cpp's graph has it {renormalizes}"
    return None


# Qwen2MoeModel.modify_tensors merges mlp.experts.N.* into ffn_*_exps; the shared expert is *_shexp
_MOE_GGUF_TENSORS = {
    **{name: gguf for name, gguf in LLAMA_GGUF_TENSORS.items() if not name.startswith("mlp.")},
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.*.gate_proj": "ffn_gate_exps",
    "mlp.experts.*.up_proj": "ffn_up_exps",
    "mlp.experts.*.down_proj": "ffn_down_exps",
}
_SHEXP = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
QWEN2_MOE_GGUF = GgufArchitecture(
    "qwen2moe",
    tensors={
        **_MOE_GGUF_TENSORS,
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
    },
    required=(*GGUF_ATTENTION, "ffn_norm", *GGUF_EXPERTS, *_SHEXP),
    keys=_gguf_keys,
    required_keys=("expert_count", "expert_used_count"),
    problem=lambda config: _gguf_problem(config, renormalizes=False),
    output_required=True,  # llama_model_qwen2moe::load_arch_tensors: output.weight, no tied fallback
)
QWEN3_MOE_GGUF = GgufArchitecture(
    "qwen3moe",
    attention_bias=False,
    tensors=_MOE_GGUF_TENSORS,
    required=(*GGUF_ATTENTION, "attn_q_norm", "attn_k_norm", "ffn_norm", *GGUF_EXPERTS),
    keys=_gguf_keys,
    required_keys=("expert_count", "expert_used_count"),
    problem=lambda config: _gguf_problem(config, renormalizes=True),
)
_EXPERT = "mlp.experts.*"
_SHARED = "mlp.shared_expert"
QWEN2_MOE_LAYOUT = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    sequential_groups=(
        *LLAMA_LAYOUT.sequential_groups[:2],
        ("mlp.gate",),  # the router, when quantized (--quantize-router): the experts then see its routing
        (f"{_EXPERT}.gate_proj", f"{_EXPERT}.up_proj", f"{_SHARED}.gate_proj", f"{_SHARED}.up_proj")
        + LLAMA_LAYOUT.sequential_groups[2],
        (f"{_EXPERT}.down_proj", f"{_SHARED}.down_proj") + LLAMA_LAYOUT.sequential_groups[3],
    ),
    smoothing_groups=(
        *LLAMA_LAYOUT.smoothing_groups,  # the attention, and the dense MLP of mlp_only_layers
        (f"{_EXPERT}.up_proj", (f"{_EXPERT}.down_proj",), f"{_EXPERT}.down_proj"),
        (f"{_SHARED}.up_proj", (f"{_SHARED}.down_proj",), f"{_SHARED}.down_proj"),
    ),
    unsmoothable=(
        ((f"{_EXPERT}.gate_proj", f"{_EXPERT}.up_proj", f"{_SHARED}.gate_proj", f"{_SHARED}.up_proj"), ROUTED_NORM),
    ),
    runtime="optkit.models.llama:CausalLM",
    moe=MoELayout(
        block="mlp",
        expert_linears=("gate_proj", "up_proj", "down_proj"),
        num_experts_keys=("num_experts", "num_local_experts"),  # Qwen3MoeConfig saves the latter
        intermediate_key="moe_intermediate_size",
        renormalize=lambda config: bool(config.get("norm_topk_prob", False)),
        is_sparse=_is_sparse,
        shared_expert="shared_expert",
        shared_expert_gate="shared_expert_gate",
        shared_intermediate_key="shared_expert_intermediate_size",
    ),
    types={
        "qwen2_moe": ModelType(replace(QWEN2_READING, fields=_qwen2_moe), QWEN2_MOE_GGUF, vllm="Qwen2MoeForCausalLM")
    },
)
QWEN2_MOE = register_family(QWEN2_MOE_LAYOUT)
QWEN3_MOE = register_family(
    replace(
        QWEN2_MOE_LAYOUT,
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        moe=replace(QWEN2_MOE_LAYOUT.moe, shared_expert=None, shared_expert_gate=None, shared_intermediate_key=None),
        # Qwen3's config keys; the head width is hidden_size / num_attention_heads unless config.json says
        types={
            "qwen3_moe": ModelType(replace(QWEN3_READING, head_dim=None), QWEN3_MOE_GGUF, vllm="Qwen3MoeForCausalLM")
        },
    )
)
