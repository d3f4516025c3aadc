"""Mixtral: Mistral's attention, and a sparse MoE block (`block_sparse_moe` in checkpoints, `mlp` in
transformers 5 and the runtime) of `num_local_experts` SwiGLU experts (w1 gate, w3 up, w2 down), of
which a router (`gate`) picks `num_experts_per_tok` per token; their softmax weights are always
renormalized over the chosen experts.

AWQ folds no scale into post_attention_layernorm here: the router reads the same normalized input,
so a scale there would change the routing unless folded into the router too, and one scale would
have to serve every expert. Each expert's up -> down pair folds as in a dense MLP.
"""

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
from optkit.families.llama import LLAMA_LAYOUT, MISTRAL_READING, every_layer_slides

ROUTED_NORM = "the router reads post_attention_layernorm's output too, and one scale would serve every expert"
_ATTENTION_GROUPS = LLAMA_LAYOUT.sequential_groups[:2]
_ATTENTION_SMOOTHING = LLAMA_LAYOUT.smoothing_groups[:2]

# LlamaModel.modify_tensors merges block_sparse_moe.experts.N.w1/w3/w2 into ffn_gate/up/down_exps
MIXTRAL_GGUF_TENSORS = {
    **{name: gguf for name, gguf in LLAMA_GGUF_TENSORS.items() if not name.startswith("mlp.")},
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.*.w1": "ffn_gate_exps",
    "mlp.experts.*.w3": "ffn_up_exps",
    "mlp.experts.*.w2": "ffn_down_exps",
}


def _gguf_problem(config: dict) -> str | None:
    window = every_layer_slides(config).get("sliding_window")
    return f"sliding_window {window}: llama.cpp's llama graph has no sliding window" if window else None


MIXTRAL_GGUF = GgufArchitecture(
    "llama",
    llama_rope=True,
    tensors=MIXTRAL_GGUF_TENSORS,
    required=(*GGUF_ATTENTION, "ffn_norm", *GGUF_EXPERTS),
    required_keys=("expert_count", "expert_used_count"),
    problem=_gguf_problem,
)
MIXTRAL = register_family(
    Family(
        name="mixtral",
        model_types=("mixtral",),
        sequential_groups=(
            *_ATTENTION_GROUPS,
            ("mlp.gate",),  # the router, when quantized (--quantize-router): the experts then see its routing
            ("mlp.experts.*.w1", "mlp.experts.*.w3"),
            ("mlp.experts.*.w2",),
        ),
        smoothing_groups=(*_ATTENTION_SMOOTHING, ("mlp.experts.*.w3", ("mlp.experts.*.w2",), "mlp.experts.*.w2")),
        unsmoothable=((("mlp.experts.*.w1", "mlp.experts.*.w3"), ROUTED_NORM),),
        runtime="optkit.models.llama:CausalLM",
        moe=MoELayout(
            block="mlp",
            expert_linears=("w1", "w3", "w2"),
            num_experts_keys=("num_local_experts",),
            intermediate_key="intermediate_size",
            renormalize=lambda config: True,
        ),
        checkpoint_renames=((".block_sparse_moe.", ".mlp."),),
        types={"mixtral": ModelType(MISTRAL_READING, MIXTRAL_GGUF, vllm="MixtralForCausalLM")},  # Mistral's keys
    )
)
