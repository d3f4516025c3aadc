"""Model families, found by `model_type`: what quantization needs to know of a decoder layer
(the linears in true-sequential order, the smoothing groups), which runtime module runs it, how the
runtime reads its config.json, and what llama.cpp and vLLM call it.

Adding a family (a MoE, Gemma, Phi-3...): one module that calls `register_family`. Every module of
this package is imported the first time the registry is asked (from outside optkit: import yours
before). A model_type no family claims is calibrated with Llama's names (only the names its layers
have count; other linears go last, one at a time), and the runtime refuses it.
"""

import fnmatch
import logging
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

from optkit.plugins import import_once

# (module whose output channels absorb 1/s, linears scaled by s, block whose output is compared)
SmoothingGroup = tuple[str, tuple[str, ...], str]


@dataclass(frozen=True)
class MoELayout:
    """A mixture-of-experts block, as its checkpoints store it: one router linear, `experts.N.<name>`
    linears for each expert (gate, up, down), optionally a shared expert (a plain MLP) scaled by a
    sigmoid gate. Names are local to the decoder layer's module; the config keys are config.json's."""

    block: str  # the MoE block's module name in the decoder layer, e.g. "mlp"
    expert_linears: tuple[str, str, str]  # (gate, up, down) of one expert, e.g. ("w1", "w3", "w2")
    num_experts_keys: tuple[str, ...]  # config.json keys of the number of experts, the first present counts
    intermediate_key: str  # config.json key of an expert's intermediate size
    # whether the top-k routing weights are divided by their sum (Mixtral: always; Qwen: norm_topk_prob)
    renormalize: Callable[[dict], bool]
    # whether decoder layer `index` has the MoE block (Qwen: decoder_sparse_step, mlp_only_layers)
    is_sparse: Callable[[dict, int], bool] = lambda config, index: True
    router: str = "gate"
    shared_expert: str | None = None  # a plain MLP every token goes through (Qwen2-MoE)
    shared_expert_gate: str | None = None  # linear [1, hidden]: sigmoid(gate(x)) scales the shared expert
    shared_intermediate_key: str | None = None

    def num_experts(self, config: dict) -> int:
        return next((config[k] for k in self.num_experts_keys if config.get(k) is not None), 0)

    @property
    def router_name(self) -> str:
        """The router's name local to the decoder layer, e.g. "mlp.gate"."""
        return f"{self.block}.{self.router}"

    @property
    def full_precision(self) -> tuple[str, ...]:
        """The gates: linears that route rather than compute, kept in full precision."""
        return tuple(f"{self.block}.{n}" for n in (self.router, self.shared_expert_gate) if n)

    @property
    def expert_patterns(self) -> tuple[str, ...]:
        return tuple(f"{self.block}.experts.*.{n}" for n in self.expert_linears)

    def dims(self, config: dict) -> tuple[int, int, int]:
        """(number of experts, experts per token, expert intermediate size) from config.json."""
        return self.num_experts(config), config["num_experts_per_tok"], config[self.intermediate_key]


def _no_fields(config: dict) -> dict:
    return {}


@dataclass(frozen=True)
class ConfigReading:
    """How the runtime (models/config.py) reads one model_type's config.json, beyond what every
    family shares (the sizes, rms_norm_eps, tie_word_embeddings, eos_token_id and RoPE).

    defaults: transformers' config-class defaults of the keys a config.json may leave out, applied
    where a key is absent (not where it is null). max_position_embeddings needs one, or config.json
    must give it. fields: the family's `ModelConfig` fields (models/config.py names them: qkv_bias,
    qk_norm, sliding_window...) from config.json with its defaults; a family that sets hidden_act
    checks it itself (otherwise it must be silu). head_dim: the head width where config.json gives
    none (None: hidden_size / num_attention_heads). language_model: a multimodal config.json ->
    its language model's (Gemma 3's text_config). rope_sources: ModelConfig's RoPE field
    (rope_parameters, local_rope_parameters) -> the config.json view its RoPE is read from (None:
    rope_parameters from config.json). rope_type_aliases: old rope_type names the config class reads
    as another (Phi-3's "su" as "longrope")."""

    defaults: Mapping[str, object] = field(default_factory=dict)
    fields: Callable[[dict], dict] = _no_fields
    head_dim: int | None = None
    language_model: Callable[[dict], dict] | None = None
    rope_sources: Callable[[dict], dict[str, dict]] | None = None
    rope_type_aliases: Mapping[str, str] = field(default_factory=dict)


# a decoder layer's tensors (local names, as the runtime's modules call them) -> llama.cpp's (after
# "blk.N."), as gguf-py's TensorNameMap maps them for LlamaModel, Qwen2Model and Qwen3Model
LLAMA_GGUF_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_ATTENTION = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
LLAMA_GGUF_REQUIRED = (*GGUF_ATTENTION, "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
GGUF_EXPERTS = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _no_problem(config: dict) -> str | None:
    return None


@dataclass(frozen=True)
class GgufArchitecture:
    """How llama.cpp's converter (convert_hf_to_gguf.py, conversion/*.py) writes a model_type: its
    architecture (general.architecture, the prefix of its keys), and whether it is LlamaModel's kind,
    whose q/k rows go to GGML's interleaved RoPE order and which also writes vocab_size and
    rope.dimension_count (the others run NEOX RoPE on Hugging Face's order).

    tensors: a decoder layer's tensors -> llama.cpp's names; a `*` (the expert's index) stacks every
    expert's tensor into one 3-D tensor, as the converter merges them. required: the block tensors
    llama.cpp's loader creates as required (`optkit verify` checks them). norm_offset: added to every
    norm weight (Gemma's converter writes 1 + w). keys: the architecture's own metadata beyond
    TextModel's, from the language model's config.json with its defaults ("KEY" after "{arch}." ->
    value: an int is a u32, a float an f32, a bool a bool, a str a string, a list of bools an array).
    required_keys: keys its loader reads with no default. problem: what in a config.json llama.cpp's
    graph for it cannot run, in one line (None: it runs it). output_required: its loader has no tied
    output (output.weight is written from the embeddings). rope_types: the RoPE scalings written.
    extra_tensors: F32 tensors the converter generates (Phi-3's LongRoPE factors). full_qk_norm: q/k
    norms span all heads (OLMo 2), not one head."""

    name: str
    llama_rope: bool = False
    attention_bias: bool = True  # its graph in llama.cpp adds attention biases (Qwen3's has none)
    tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_TENSORS)
    required: tuple[str, ...] = LLAMA_GGUF_REQUIRED
    norm_offset: float = 0.0
    keys: Callable[[dict], dict] = _no_fields
    required_keys: tuple[str, ...] = ()
    problem: Callable[[dict], str | None] = _no_problem
    output_required: bool = False
    rope_types: tuple[str, ...] = ("default", "linear", "llama3")
    extra_tensors: Callable[[dict], dict] = _no_fields
    full_qk_norm: bool = False


@dataclass(frozen=True)
class ModelType:
    """What one model_type of a family is to the runtime, llama.cpp and vLLM. gguf: None where
    --format gguf does not write it; vllm: the model class vLLM's registry runs it with (config.json's
    `architectures`), None where vLLM has none."""

    config: ConfigReading = field(default_factory=ConfigReading)
    gguf: GgufArchitecture | None = None
    vllm: str | None = None


@dataclass(frozen=True)
class Family:
    """sequential_groups: local linear names of one decoder layer, grouped in the order calibration
    quantizes them (each group's inputs come from the already-quantized groups before it).
    smoothing_groups: which norm or linear precedes which linears (AWQ uses all of them; SmoothQuant
    the norm-fed ones, `norm_groups`). runtime: "module:class" of the runtime model (optkit/models/),
    named as text so quant/ never imports the runtime. unsmoothable: linears no norm or linear of the
    layer precedes in a way a scale folds into, with the reason (AWQ/SmoothQuant skip them and say so).
    embedding_scale: the factor the model multiplies its embeddings by, from the transformers config
    (calibration feeds the first layer what the model would)."""

    name: str
    model_types: tuple[str, ...]
    sequential_groups: tuple[tuple[str, ...], ...]
    smoothing_groups: tuple[SmoothingGroup, ...] = ()
    runtime: str | None = None
    unsmoothable: tuple[tuple[tuple[str, ...], str], ...] = ()
    embedding_scale: Callable[[object], float] | None = None
    # the norms scale by (offset + weight) (Gemma: 1): a smoothing scale s folds as w ← (offset + w)/s − offset
    norm_weight_offset: float = 0.0
    # (checkpoint prefix, runtime prefix) where they differ, and checkpoint prefixes the runtime leaves
    # out, with the reason (Gemma 3's vision tower): the runtime model's view of the checkpoint
    runtime_renames: tuple[tuple[str, str], ...] = ()
    outside_runtime: tuple[tuple[str, ...], str] | None = None
    moe: MoELayout | None = None
    # (checkpoint infix, module infix): a checkpoint's names where they differ from the modules',
    # e.g. Mixtral's ".block_sparse_moe." for transformers' and the runtime's ".mlp."
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # model_type -> what it is to the runtime, llama.cpp and vLLM; one left out reads as a plain
    # Llama config.json (no biases, silu, full attention) and neither tool runs it
    types: Mapping[str, ModelType] = field(default_factory=dict)

    def model_type(self, name: str | None) -> ModelType:
        return self.types.get(name) or ModelType()

    def module_name(self, checkpoint_name: str) -> str:
        """A checkpoint key (full, or local to a decoder layer) as the modules name it."""
        name = f".{checkpoint_name}"
        for stored, module in self.checkpoint_renames:
            name = name.replace(stored, module)
        return name[1:]

    def checkpoint_name(self, module_name: str) -> str:
        name = f".{module_name}"
        for stored, module in self.checkpoint_renames:
            name = name.replace(module, stored)
        return name[1:]

    def runtime_name(self, checkpoint_key: str) -> str | None:
        """A checkpoint key under the runtime's names (Gemma 3's language_model.model.* -> model.*,
        Mixtral's block_sparse_moe -> mlp); None for what the runtime leaves out (`outside_runtime`)."""
        prefixes = self.outside_runtime[0] if self.outside_runtime else ()
        if checkpoint_key.startswith(prefixes):
            return None
        for stored, runtime in self.runtime_renames:
            if checkpoint_key.startswith(stored):
                checkpoint_key = runtime + checkpoint_key.removeprefix(stored)
                break
        return self.module_name(checkpoint_key)

    @property
    def norm_groups(self) -> tuple[SmoothingGroup, ...]:
        """The smoothing groups fed by a norm (not by another linear of the layer)."""
        linears = {n for group in self.sequential_groups for n in group}
        return tuple(g for g in self.smoothing_groups if g[0] not in linears)


log = logging.getLogger(__name__)


def expand_group(names: tuple[str, ...], present: list[str]) -> list[str]:
    """A group of local names where `*` (an expert's index) matches the layer's modules `present`,
    in their order: `mlp.experts.*.w1` -> mlp.experts.0.w1, mlp.experts.1.w1, ..."""
    return [n for pattern in names for n in (fnmatch.filter(present, pattern) if "*" in pattern else [pattern])]


def expand_smoothing_groups(groups: tuple[SmoothingGroup, ...], present: list[str]) -> list[SmoothingGroup]:
    """Smoothing groups with `*` in the preceding module name become one group per expert (the
    same index throughout); `*` only in the linears expands to all of them."""
    expanded = []
    for previous, linears, block in groups:
        if "*" not in previous:
            expanded.append((previous, tuple(expand_group(linears, present)), block))
            continue
        head, _, tail = previous.partition("*")
        for name in fnmatch.filter(present, previous):
            index = name[len(head) : len(name) - len(tail)]
            expanded.append((name, tuple(n.replace("*", index) for n in linears), block.replace("*", index)))
    return expanded


def log_unsmoothable(family: Family, method: str) -> None:
    """One log line per group of linears that `method` (AWQ, SmoothQuant) cannot smooth."""
    for linears, reason in family.unsmoothable:
        log.warning("%s: %s leaves %s unsmoothed: %s", family.name, method, ", ".join(linears), reason)


_FALLBACK = "llama"
_REGISTRY: dict[str, Family] = {}
_BUILTIN = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)))  # one module per family
_load_builtin = import_once(__name__, _BUILTIN)


def register_family(family: Family) -> Family:
    _load_builtin()
    taken = [t for t in family.model_types if t in _REGISTRY]
    if taken:
        raise ValueError(f"model_type {taken[0]!r} already belongs to family {_REGISTRY[taken[0]].name!r}")
    _REGISTRY.update(dict.fromkeys(family.model_types, family))
    return family


def unregister_family(family: Family) -> None:
    for model_type in family.model_types:
        if _REGISTRY.get(model_type) is family:
            del _REGISTRY[model_type]


@contextmanager
def registered_family(family: Family) -> Iterator[Family]:
    """`register_family` for the duration of a block (tests)."""
    register_family(family)
    try:
        yield family
    finally:
        unregister_family(family)


def family_for(model_type: str | None) -> Family:
    _load_builtin()
    return _REGISTRY.get(model_type) or _REGISTRY[_FALLBACK]


def model_types(runtime: bool = False) -> tuple[str, ...]:
    """Every registered model_type (with `runtime`, those the optkit runtime runs)."""
    _load_builtin()
    return tuple(t for t, f in _REGISTRY.items() if f.runtime or not runtime)


def gguf_architectures() -> dict[str, GgufArchitecture]:
    """model_type -> its llama.cpp architecture, for every model_type --format gguf writes
    (registration order: a GGUF file reads back as the first model_type of its architecture)."""
    _load_builtin()
    found = {t: f.model_type(t).gguf for t, f in _REGISTRY.items()}
    return {t: arch for t, arch in found.items() if arch is not None}
