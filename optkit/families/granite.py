"""IBM Granite 3: Llama's decoder layer names, with embedding, residual, attention and logit
multipliers (config fields, which the runtime reads as GraniteConfig does)."""

from dataclasses import replace

from optkit.families import ConfigReading, GgufArchitecture, ModelType, register_family
from optkit.families.llama import LLAMA_LAYOUT, LLAMA_READING


def _number(config: dict, key: str) -> float:
    """A multiplier of config.json (hf_config checked it is finite); 1 when absent or null."""
    value = config.get(key)
    return 1.0 if value is None else float(value)


def _multipliers(config: dict) -> dict:
    """h = embed·embedding_multiplier; h += sublayer·residual_multiplier; attention scores scaled
    by attention_multiplier; logits / logits_scaling."""
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    return {**LLAMA_READING.fields(config), **{key: _number(config, key) for key in keys}}


def _gguf_keys(config: dict) -> dict:
    """GraniteModel.set_gguf_parameters' multipliers as llama.cpp's scales, written even where they
    are 1 (absent: transformers multiplies by 1, llama.cpp's attention would take 1/√head_dim)."""
    fields = _multipliers(config)
    return {
        "attention.scale": fields["attention_multiplier"],
        "embedding_scale": fields["embedding_multiplier"],
        "residual_scale": fields["residual_multiplier"],
        "logit_scale": fields["logits_scaling"],
    }


GRANITE_GGUF = GgufArchitecture("granite", llama_rope=True, keys=_gguf_keys, required_keys=("logit_scale",))
GRANITE = register_family(
    replace(
        LLAMA_LAYOUT,
        name="granite",
        model_types=("granite",),
        embedding_scale=lambda config: config.embedding_multiplier,
        types={
            "granite": ModelType(
                ConfigReading(defaults={"max_position_embeddings": 2048}, fields=_multipliers),
                GRANITE_GGUF,
                vllm="GraniteForCausalLM",
            )
        },
    )
)
