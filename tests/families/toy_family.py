"""A runtime family from outside optkit, in one module: `toyllama`, a Llama with its own model_type
and transformers classes (what a new architecture brings), run by optkit's Llama runtime.

Everything optkit needs is in `TOY_LLAMA`: the decoder layer's linears and smoothing groups (Llama's),
the runtime module, how the runtime reads config.json (with a default context for a config.json
that leaves max_position_embeddings out), the llama.cpp architecture it converts as, and no vLLM
model (vLLM has no class of this name)."""

from dataclasses import replace

from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from optkit.families import ConfigReading, GgufArchitecture, ModelType
from optkit.families.llama import LLAMA_LAYOUT, LLAMA_READING

MODEL_TYPE = "toyllama"


class ToyLlamaConfig(LlamaConfig):
    model_type = MODEL_TYPE


class ToyLlamaForCausalLM(LlamaForCausalLM):
    config_class = ToyLlamaConfig


AutoConfig.register(MODEL_TYPE, ToyLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(ToyLlamaConfig, ToyLlamaForCausalLM, exist_ok=True)

TOY_LLAMA = replace(
    LLAMA_LAYOUT,
    name="toyllama",
    model_types=(MODEL_TYPE,),
    types={
        MODEL_TYPE: ModelType(
            ConfigReading(defaults={"max_position_embeddings": 512}, fields=LLAMA_READING.fields),
            gguf=GgufArchitecture("llama", llama_rope=True),
        )
    },
)
