"""A GGUF file type (`--gguf-type`, formats/gguf_mix.py) applied by the writer: `general.file_type`,
the type of each tensor the methods did not quantize (the embeddings and the output are
round-to-nearest in the mix's type, as llama-quantize makes them; F16/BF16/F32 cast every matrix),
and each quantized linear's type in the manifest's layer records (`gguf_type`)."""

import numpy as np
import torch

from optkit.errors import OptkitError
from optkit.families import family_for
from optkit.quant.formats import gguf_mix
from optkit.quant.formats.gguf_metadata import language_model_config

# a planned tensor of the writer (formats/gguf_plan.py): .name (llama.cpp's), .keys (the staged
# tensors: one, or each expert's), .quantized (packed blocks)
PlannedTensor = object

OUTSIDE_BLOCKS = ("token_embd", "output")  # categories the methods never quantize


def file_type_id(manifest: dict, blocks_file_type: int) -> int:
    """`general.file_type`: the file type's LLAMA_FTYPE, else that of the linears' blocks."""
    gguf = manifest["options"].get("gguf")
    return gguf_mix.FILE_TYPES[gguf["type"]].file_type if gguf else blocks_file_type


def mix_model(config: dict) -> gguf_mix.Model:
    view = language_model_config(config)
    moe = family_for(config.get("model_type")).moe
    heads = view["num_attention_heads"]
    experts = moe.num_experts(view) if moe is not None else 0
    return gguf_mix.Model(view["num_hidden_layers"], heads, view.get("num_key_value_heads") or heads, experts)


def mix_types(gguf_type: str, plan: list[PlannedTensor], config: dict, dims) -> dict[str, str | None]:
    """gguf_mix's type of each planned tensor in file type `gguf_type`; `dims(entry)` its GGUF dims."""
    tensors = [gguf_mix.Tensor(entry.name, dims(entry)) for entry in plan]
    return gguf_mix.tensor_types(gguf_type, tensors, mix_model(config))


def linear_types(gguf_type: str, plan: list[PlannedTensor], config: dict, shape_of) -> dict[str, str]:
    """Before quantizing: the type of each linear (checkpoint name) of the base model's `plan` in
    file type `gguf_type`; `shape_of(key)` is a checkpoint tensor's shape."""
    types = mix_types(gguf_type, plan, config, lambda entry: _dims(entry, list(shape_of(entry.keys[0]))))
    return {key.removesuffix(".weight"): types[e.name] for e in plan if types[e.name] for key in e.keys}


def _dims(entry: PlannedTensor, shape: list[int]) -> tuple[int, ...]:
    """GGUF's dims of a planned tensor whose (first) staged tensor is [rows, row]: experts stacked last."""
    return (*reversed(shape), *((len(entry.keys),) if len(entry.keys) > 1 else ()))


def planned_types(plan: list[PlannedTensor], manifest: dict, config: dict, shape_of) -> dict[str, str | None]:
    """The type to write for each planned tensor (None: as stored); {} without a file type.
    `shape_of(key)` is a staged tensor's shape. Linears the recipe keeps in full precision (`ignore`)
    stay so in a quantized mix; a packed linear whose bytes are not those of the type the mix gives
    it is an OptkitError."""
    gguf = manifest["options"].get("gguf")
    if gguf is None:
        return {}
    layers = {layer["name"]: layer["shape"] for layer in manifest["layers"]}

    def dims(entry: PlannedTensor) -> tuple[int, ...]:
        layer = entry.keys[0].rsplit(".", 1)[0]
        return _dims(entry, layers[layer] if entry.quantized else list(shape_of(entry.keys[0])))

    types = mix_types(gguf["type"], plan, config, dims)
    full_precision = gguf_mix.FILE_TYPES[gguf["type"]].default in gguf_mix.FULL_PRECISION
    chosen = {}
    for entry in plan:
        if entry.quantized:
            qtype = types[entry.name]
            if qtype is None or shape_of(entry.keys[0])[-1] != _row_bytes(qtype, dims(entry)[0]):
                raise OptkitError(f"{entry.name}: GGUF {gguf['type']} stores it as {types[entry.name]}: quantize again")
            chosen[entry.name] = types[entry.name]
        elif full_precision:  # what is not a quantizable matrix (norms, MoE routers) in F32, as the converter
            chosen[entry.name] = types[entry.name] or "F32"
        elif gguf_mix.category(entry.name) in OUTSIDE_BLOCKS:
            chosen[entry.name] = types[entry.name]
    return chosen


def _row_bytes(qtype: str, row: int) -> int:
    """The bytes of a row of `row` values in ggml type `qtype`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return row // block * size


def with_layer_types(manifest: dict, plan: list[PlannedTensor], types: dict[str, str | None]) -> dict:
    """The manifest with each quantized linear's GGUF type in its layer record (with a file type)."""
    if manifest["options"].get("gguf") is None:
        return manifest
    packed = {key.rsplit(".", 1)[0]: types[entry.name] for entry in plan if entry.quantized for key in entry.keys}
    layers = [
        {**layer, "gguf_type": packed[layer["name"]]} if layer["name"] in packed else layer
        for layer in manifest["layers"]
    ]
    return {**manifest, "layers": layers}


def tensor_bytes(tensor: torch.Tensor, qtype: str) -> tuple[np.ndarray, object]:
    """A full-precision tensor in ggml type `qtype`: (array, raw GGML type)."""
    from gguf import GGMLQuantizationType as T

    if qtype == "F32":
        return tensor.float().numpy(), T.F32
    if qtype == "F16":
        half = tensor.to(torch.float16)
        if not torch.isfinite(half).all() and torch.isfinite(tensor).all():
            raise OptkitError("a weight exceeds float16's range (±65504): use --gguf-type BF16 or F32")
        return half.numpy(), T.F16
    if qtype == "BF16":
        return tensor.to(torch.bfloat16).contiguous().view(torch.uint8).numpy(), T.BF16
    return _quantized(tensor, qtype).numpy(), T[qtype]


def _quantized(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """Round to nearest in `qtype`'s blocks: ggml's grid for a K type, fp16 scales for a legacy one."""
    if qtype in gguf_mix.K_TYPES:
        from optkit.weights import kquants

        return kquants.quantize_rows(weight.float(), qtype)[0]
    from optkit.quant.methods.rtn.math import rtn_quantize
    from optkit.weights import gguf_blocks

    if qtype not in gguf_mix.BLOCK_SCHEMES:
        raise OptkitError(f"--format gguf does not write {qtype} blocks yet: choose another --gguf-type")
    qw = rtn_quantize(weight.float(), gguf_mix.block_scheme(qtype), torch.float16)
    return gguf_blocks.pack(qtype, qw.q, qw.scale, qw.zero_point if qtype in gguf_blocks.WITH_MINIMUM else None)
