"""Which tensors a .gguf holds and how each comes from the staged artifact, as llama.cpp's converter
writes them (convert_hf_to_gguf.py: TextModel.prepare_tensors, each model class's modify_tensors):
the family's names (families/: `GgufArchitecture.tensors`), every expert's linear stacked into one
3-D tensor [experts, rows, ...] (LlamaModel and Qwen2MoeModel merge them so), Llama's q/k rows in
GGML's RoPE order, Gemma's norms as 1 + w, the vision tower of a multimodal checkpoint left out (the
converter writes it to a separate mmproj file), and output.weight written from the embeddings where
the architecture's loader has no tied output.

Names here are the runtime's (Gemma 3's language_model.model.* read as model.*, Mixtral's
block_sparse_moe as mlp); the staged keys are kept to read each tensor."""

import fnmatch
from dataclasses import dataclass

import numpy as np
import torch

from optkit.errors import OptkitError
from optkit.families import GgufArchitecture, family_for
from optkit.quant.formats import gguf_metadata as meta

GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


@dataclass(frozen=True)
class PlannedTensor:
    name: str  # llama.cpp's
    keys: tuple[str, ...]  # the staged tensors: one, or each expert's in index order (stacked)
    hf: str  # the runtime's name of the (first) tensor, e.g. model.layers.0.self_attn.q_proj.weight
    quantized: bool  # the staged tensors are packed blocks (`marker`)


def gguf_name(hf_name: str, arch: GgufArchitecture) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight; an expert's linear
    (model.layers.3.mlp.experts.5.w1.weight) -> the stacked tensor's name (blk.3.ffn_gate_exps.weight)."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"]:
        local = parts[3]
        name = arch.tensors.get(local)
        if name is None:
            name = next((n for p, n in arch.tensors.items() if "*" in p and fnmatch.fnmatchcase(local, p)), None)
        if name is not None:
            return f"blk.{parts[2]}.{name}.{suffix}"
    raise OptkitError(f"{hf_name}: llama.cpp's {arch.name} has no tensor of that name: use --format compressed-tensors")


def hf_name(name: str, arch: GgufArchitecture) -> str:
    """Inverse of `gguf_name` for tensors that are not stacked experts."""
    stem, _, suffix = name.rpartition(".")
    for hf, gg in GLOBAL_TENSORS.items():
        if stem == gg:
            return f"{hf}.{suffix}"
    parts = stem.split(".", 2)
    inverse = {v: k for k, v in arch.tensors.items() if "*" not in k}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in inverse:
        return f"model.layers.{parts[1]}.{inverse[parts[2]]}.{suffix}"
    raise OptkitError(f"GGUF tensor {name!r} is not one optkit reads")


def expert_index(hf: str) -> int:
    """The expert's index in a runtime name (model.layers.0.mlp.experts.5.w1.weight -> 5)."""
    parts = hf.split(".")
    return int(parts[parts.index("experts") + 1])


def plan(keys: list[str], config: dict, marker: str) -> list[PlannedTensor]:
    """The file's tensors in the converter's order (token_embd, blk.0.*, ..., output_norm, output)."""
    family = family_for(config.get("model_type"))
    arch = meta.gguf_architecture(config)
    view = meta.language_model_config(config)
    groups: dict[str, list[tuple[str, str, bool]]] = {}
    for key in keys:
        runtime = family.runtime_name(key)
        if runtime is None or runtime.endswith("rotary_emb.inv_freq"):
            continue
        quantized = runtime.endswith(f".{marker}")
        hf = runtime.removesuffix(f".{marker}") + ".weight" if quantized else runtime
        if hf == "lm_head.weight" and view.get("tie_word_embeddings"):
            continue
        groups.setdefault(gguf_name(hf, arch), []).append((key, hf, quantized))
    planned = [_planned(name, members, family, view) for name, members in groups.items()]
    if arch.output_required and "output.weight" not in groups and "token_embd.weight" in groups:
        planned.append(PlannedTensor("output.weight", *_only(groups["token_embd.weight"])))
    return sorted(planned, key=lambda p: _file_order(p.name))


def _only(members: list[tuple[str, str, bool]]) -> tuple[tuple[str, ...], str, bool]:
    (key, hf, quantized), *_ = members
    return (key,), hf, quantized


def _planned(name: str, members: list[tuple[str, str, bool]], family, view: dict) -> PlannedTensor:
    if len(members) == 1 and ".experts." not in members[0][1]:
        return PlannedTensor(name, *_only(members))
    members = sorted(members, key=lambda m: expert_index(m[1]))
    experts = family.moe.num_experts(view) if family.moe is not None else 0
    if [expert_index(hf) for _, hf, _ in members] != list(range(experts)):
        raise OptkitError(f"{name}: the artifact does not hold each of the {experts} experts' tensors once")
    if len({quantized for _, _, quantized in members}) > 1:
        raise OptkitError(f"{name}: some experts are quantized and some not; llama.cpp stacks them as one tensor")
    return PlannedTensor(name, tuple(m[0] for m in members), members[0][1], members[0][2])


def tensor(read, entry: PlannedTensor, config: dict) -> torch.Tensor:
    """The planned tensor's data (`read(key)` gives a staged tensor): experts stacked, Llama's q/k
    rows permuted, Gemma's norms as 1 + w (packed blocks stay bytes: rows move whole)."""
    arch = meta.gguf_architecture(config)
    view = meta.language_model_config(config)
    parts = [read(key) for key in entry.keys]
    data = torch.stack(parts) if len(parts) > 1 else parts[0]
    heads = meta.qk_heads(view, entry.hf)
    if heads is not None:
        data = meta.permute_qk(data, heads)
    if arch.norm_offset and entry.name.endswith("norm.weight"):
        # the converter adds in float32 (float16 stays float16: TextModel.prepare_tensors) and writes F32
        data = (data if data.dtype == torch.float16 else data.float()) + arch.norm_offset
    return data


def extra_tensors(config: dict) -> dict[str, np.ndarray]:
    """The F32 tensors the converter generates, by name: Llama 3.1's rope_freqs (LlamaModel), the
    family's own (Phi-3's LongRoPE factors)."""
    tensors = {}
    if meta.full_rope(config).get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = meta.llama3_rope_factors(meta.language_model_config(config)).numpy()
    extra = meta.gguf_architecture(config).extra_tensors(meta.language_model_config(config))
    return tensors | {name: np.asarray(values, dtype=np.float32) for name, values in extra.items()}


def _file_order(name: str) -> tuple:
    """token_embd, then blk.0.*, blk.1.*, ..., then output_norm and output (the converter's order)."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)
