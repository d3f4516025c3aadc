"""Mixtral: Mistral's attention, and a sparse MoE block (`block_sparse_moe` in checkpoints, `mlp` in
transformers 5 and the runtime) of `num_local_experts` SwiGLU experts (w1 gate, w3 up, w2 down), of
which a router (`gate`) picks `num_experts_per_tok` per token; their softmax weights are always
renormalized over the chosen experts.

AWQ folds no scale into post_attention_layernorm here: the router reads the same normalized input,
so a scale there would change the routing unless folded into the router too, and one scale would
have to serve every expert. Each expert's up -> down pair folds as in a dense MLP.
"""

from optkit.families import Family, ModelType, MoELayout, register_family
from optkit.families.llama import LLAMA_LAYOUT, MISTRAL_READING

ROUTED_NORM = "the router reads post_attention_layernorm's output too, and one scale would serve every expert"
_ATTENTION_GROUPS = LLAMA_LAYOUT.sequential_groups[:2]
_ATTENTION_SMOOTHING = LLAMA_LAYOUT.smoothing_groups[:2]

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
        types={"mixtral": ModelType(MISTRAL_READING, vllm="MixtralForCausalLM")},  # Mistral's config keys
    )
)
