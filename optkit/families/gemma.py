"""Google Gemma 2 and Gemma 3 (text, and the language model of the multimodal Gemma 3).

Each decoder layer has "sandwich" norms: input_layernorm → attention → post_attention_layernorm
(on the attention's output) → residual add, then pre_feedforward_layernorm → MLP →
post_feedforward_layernorm → residual add. So the norms that feed linears are input_layernorm
(q/k/v) and pre_feedforward_layernorm (gate/up); post_attention_layernorm feeds no linear (it
normalizes the attention's output before the residual add), unlike Llama's norm of that name.

The norms scale by (1 + w) (Gemma2RMSNorm, Gemma3RMSNorm), so a smoothing scale s folds into a norm
as (1 + w') = (1 + w)/s, i.e. w' = (1 + w)/s − 1 (`norm_weight_offset` 1).

The embeddings are multiplied by √hidden_size, rounded to the model's dtype first (as transformers'
Gemma*TextScaledWordEmbedding does with its embed_scale buffer).

Gemma 3 of 4B and up ships as `gemma3` (Gemma3ForConditionalGeneration): its checkpoint holds the
language model under language_model.model.* and a SigLIP vision tower with its projector. optkit
quantizes and serves the language model only; the vision tower and projector are copied into the
artifact in full precision and the runtime leaves them out (text in, text out).
"""

from optkit.families import Family, register_family
from optkit.families.llama import LLAMA_LAYOUT

_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


def embedding_scale(config) -> float:
    """√hidden_size rounded to the checkpoint's dtype, as transformers multiplies the embeddings."""
    import torch  # here, not at the top: the registry is read without torch (quant/supported.py)

    config = getattr(config, "text_config", None) or config
    dtype = getattr(config, "dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype or "float32"), torch.float32)
    return torch.tensor(config.hidden_size**0.5, dtype=dtype).item()


GEMMA_LAYOUT = Family(
    name="gemma2",
    model_types=("gemma2",),
    sequential_groups=LLAMA_LAYOUT.sequential_groups,  # the same linears, in the same order
    smoothing_groups=(
        ("input_layernorm", _QKV, "self_attn"),
        ("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        ("pre_feedforward_layernorm", _GATE_UP, "mlp"),
        ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ),
    runtime="optkit.models.llama:CausalLM",
    embedding_scale=embedding_scale,
    norm_weight_offset=1.0,
)
GEMMA2 = register_family(GEMMA_LAYOUT)
GEMMA3 = register_family(
    Family(**{**GEMMA_LAYOUT.__dict__, "name": "gemma3", "model_types": ("gemma3_text",)}),
)
GEMMA3_MULTIMODAL = register_family(
    Family(
        **{
            **GEMMA_LAYOUT.__dict__,
            "name": "gemma3-multimodal",
            "model_types": ("gemma3",),
            # transformers' modules are model.language_model.*, the checkpoint's language_model.model.*
            "checkpoint_renames": ((".language_model.model.", ".model.language_model."),),
            "runtime_renames": (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
            "outside_runtime": (
                ("vision_tower.", "multi_modal_projector."),
                "the vision tower and its projector stay in full precision in the artifact; "
                "the optkit runtime serves the language model (text only)",
            ),
        }
    ),
)
