"""Qwen2-MoE and Qwen3-MoE: Qwen2's (q/k/v bias) or Qwen3's (q/k norms) attention, and in each
sparse layer a router (`mlp.gate`) choosing `num_experts_per_tok` of `num_experts` SwiGLU experts
(`mlp.experts.N.gate_proj/up_proj/down_proj`), their softmax weights renormalized only with
`norm_topk_prob`. Qwen2-MoE adds a shared expert every token goes through, scaled by
sigmoid(`shared_expert_gate`). Layers in `mlp_only_layers` or off `decoder_sparse_step` keep a
dense MLP (`mlp.gate_proj/up_proj/down_proj`), quantized and smoothed as Llama's.
"""

from dataclasses import replace

from optkit.families import Family, ModelType, MoELayout, register_family
from optkit.families.llama import LLAMA_LAYOUT, QWEN2_READING, QWEN3_READING
from optkit.families.mixtral import ROUTED_NORM


def _is_sparse(config: dict, index: int) -> bool:
    step = config.get("decoder_sparse_step", 1)
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    return index not in (config.get("mlp_only_layers") or []) and experts > 0 and (index + 1) % step == 0


def _qwen2_moe(config: dict) -> dict:
    """Qwen2's fields, but the q/k/v biases follow `qkv_bias` (Qwen2MoeConfig; Qwen2 always has them)."""
    return {**QWEN2_READING.fields(config), "qkv_bias": bool(config.get("qkv_bias", True))}


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
    types={"qwen2_moe": ModelType(replace(QWEN2_READING, fields=_qwen2_moe), vllm="Qwen2MoeForCausalLM")},
)
QWEN2_MOE = register_family(QWEN2_MOE_LAYOUT)
QWEN3_MOE = register_family(
    replace(
        QWEN2_MOE_LAYOUT,
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        moe=replace(QWEN2_MOE_LAYOUT.moe, shared_expert=None, shared_expert_gate=None, shared_intermediate_key=None),
        # Qwen3's config keys; the head width is hidden_size / num_attention_heads unless config.json says
        types={"qwen3_moe": ModelType(replace(QWEN3_READING, head_dim=None), vllm="Qwen3MoeForCausalLM")},
    )
)
