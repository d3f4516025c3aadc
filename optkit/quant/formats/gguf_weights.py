"""The weights a .gguf of any family optkit writes holds, as float32 under the runtime's names, given
the model's config.json (its metadata alone says too little of Gemma, Phi-3 or a mixture of experts
for optkit's runtime: gguf_read.py reads back Llama and Qwen files whole). Every tensor goes through
gguf-py's dequantizer, what llama.cpp holds, and gguf_plan.py's steps are undone: stacked experts
split, Llama's q/k rows back in Hugging Face's order, Gemma's 1 + w norms back to w. The reference
llama.cpp's logits are checked against (tests/compat, bench/llama_cpp_families.py): `write_reference_dir`."""

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from optkit.errors import OptkitError
from optkit.quant.formats import gguf_metadata as meta
from optkit.quant.formats.gguf_check import open_for_loading
from optkit.quant.formats.gguf_plan import hf_name
from optkit.quant.formats.gguf_tensors import tensor_arrays

GENERATED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def read_weights(path: str | Path, config: dict) -> dict[str, torch.Tensor]:
    """{runtime name: float32 tensor} of the file at `path`, written from a model with `config`; its
    output.weight as lm_head.weight wherever the file holds one, tied `config` or not (llama.cpp
    computes the logits with it: OLMo 2's and Qwen2-MoE's loaders have no tied output, so a tied
    model's file holds the embedding again, in the output's type)."""
    from gguf import GGMLQuantizationType, quants

    arch, view = meta.gguf_architecture(config), meta.language_model_config(config)
    stacked = {name: pattern for pattern, name in arch.tensors.items() if "*" in pattern}
    state = {}
    for info, data in tensor_arrays(open_for_loading(path)):
        if info.name in GENERATED:
            continue
        values = torch.from_numpy(np.array(quants.dequantize(np.asarray(data), GGMLQuantizationType(info.type_id))))
        values = values.float()
        parts = info.name.split(".")
        if parts[0] == "blk" and parts[2] in stacked:
            for index, expert in enumerate(values):
                local = stacked[parts[2]].replace("*", str(index))
                state[f"model.layers.{parts[1]}.{local}.{parts[3]}"] = expert
            continue
        name = hf_name(info.name, arch)
        if arch.norm_offset and info.name.endswith("norm.weight"):
            values = values - arch.norm_offset
        heads = meta.qk_heads(view, name)
        state[name] = meta.unpermute_qk(values, heads) if heads is not None else values
    if not state:
        raise OptkitError(f"{path}: no tensors")
    return state


def write_reference_dir(path: str | Path, model_dir: Path, out: Path) -> Path:
    """optkit's runtime model directory `out` on the .gguf's own weights as llama.cpp holds them: the
    source's config.json (of `model_dir`), untied where the file holds its own output.weight."""
    config = json.loads((model_dir / "config.json").read_text())
    state = read_weights(path, config)
    if "lm_head.weight" in state:  # its own output, not the embedding's copy at the embedding's type
        for view in (config, config.get("text_config") or {}):
            view["tie_word_embeddings"] = False
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    return out
