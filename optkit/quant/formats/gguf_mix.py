"""llama.cpp's file types (`--gguf-type Q4_K_M`, ...): the ggml type each tensor of a model gets.

A file type is a mix: a default type, raised for the tensors quantization hurts most (the output,
attn_v, part of ffn_down), and a fallback for rows a type's block does not divide. This module
decides it as llama.cpp's `llama-quantize` does, from the model's tensor list alone; it follows
ggml-org/llama.cpp src/llama-quant.cpp at commit 007dbbf (llama-cpp-python 0.3.36 vendors the same
rules): `llama_ftype_get_default_type`, `tensor_allows_quantization`, `tensor_get_category`,
`init_quantize_state_counters`, `llama_tensor_get_type_impl` and `tensor_type_fallback`, over the
tensors in the loader's order (`weight_name_comparer`: by layer, then by name).

Left out, as no model optkit writes as GGUF reaches them: the Falcon, 70B-type and IQ/TQ/MXFP4 branches.
"""

import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, field_validator

from optkit.weights.stored import StoredScheme, k_scheme

QK_K = 256  # a K type's super-block
LEGACY_BLOCK = 32
BLOCK = {"Q2_K": QK_K, "Q3_K": QK_K, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}
BLOCK |= {"Q4_0": LEGACY_BLOCK, "Q4_1": LEGACY_BLOCK, "Q5_0": LEGACY_BLOCK, "Q5_1": LEGACY_BLOCK, "Q8_0": LEGACY_BLOCK}
FULL_PRECISION = ("F32", "F16", "BF16")
# tensor_type_fallback: a type whose block does not divide the row -> one of 32 columns
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
K_TYPES = tuple(FALLBACK)
# tensor_allows_quantization: 2-D weights that stay as they are stored (norms, MoE routers, ...)
_NOT_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj", "ssm_conv1d")
_BLOCK_INDEX = re.compile(r"blk\.(-?\d+)\.")


@dataclass(frozen=True)
class FileType:
    name: str  # as llama-quantize names it
    file_type: int  # llama.h's LLAMA_FTYPE_*: `general.file_type`
    default: str  # llama_ftype_get_default_type


FILE_TYPES = {
    t.name: t
    for t in (
        FileType("F32", 0, "F32"),
        FileType("F16", 1, "F16"),
        FileType("BF16", 32, "BF16"),
        FileType("Q8_0", 7, "Q8_0"),
        FileType("Q4_0", 2, "Q4_0"),
        FileType("Q4_1", 3, "Q4_1"),
        FileType("Q2_K", 10, "Q2_K"),
        FileType("Q3_K_S", 11, "Q3_K"),
        FileType("Q3_K_M", 12, "Q3_K"),
        FileType("Q3_K_L", 13, "Q3_K"),
        FileType("Q4_K_S", 14, "Q4_K"),
        FileType("Q4_K_M", 15, "Q4_K"),
        FileType("Q5_K_S", 16, "Q5_K"),
        FileType("Q5_K_M", 17, "Q5_K"),
        FileType("Q6_K", 18, "Q6_K"),
    )
}


@dataclass(frozen=True)
class Tensor:
    name: str  # GGUF name: token_embd.weight, blk.3.attn_v.weight, output.weight
    dims: tuple[int, ...]  # GGUF order: ne0 (the row length) first


@dataclass(frozen=True)
class Model:
    """What the rules read of the hyperparameters (llama_hparams)."""

    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0


# the weight scheme of the decoder's linears in a file type whose default type is a legacy block
LEGACY_SCHEMES = {
    "Q8_0": {"bits": 8, "group_size": LEGACY_BLOCK, "symmetric": True},
    "Q4_0": {"bits": 4, "group_size": LEGACY_BLOCK, "symmetric": True},
    "Q4_1": {"bits": 4, "group_size": LEGACY_BLOCK, "symmetric": False},
}
# ... and of the legacy blocks only a fallback reaches (Q4_K -> Q5_0, Q5_K -> Q5_1: weights/gguf_blocks.py)
BLOCK_SCHEMES = LEGACY_SCHEMES | {
    "Q5_0": {"bits": 5, "group_size": LEGACY_BLOCK, "symmetric": True},
    "Q5_1": {"bits": 5, "group_size": LEGACY_BLOCK, "symmetric": False},
}


class GgufOptions(BaseModel):
    """The recipe section `quantize.gguf` (`optkit quantize --gguf-type`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str  # a name of FILE_TYPES: Q4_K_M, Q8_0, F16, ...

    @field_validator("type")
    @classmethod
    def _known(cls, value: str) -> str:
        return file_type(value).name

    @property
    def full_precision(self) -> bool:
        return FILE_TYPES[self.type].default in FULL_PRECISION


def with_file_type(data: dict) -> dict:
    """QuantizeOptions' fields as given, with what a file type implies where they are left out:
    the linears' scheme of a legacy type, and every linear kept (`ignore: ["*"]`) in F16/BF16/F32
    (whose `weights` nothing reads)."""
    section = data.get("gguf")
    name = section.type if isinstance(section, GgufOptions) else None
    if isinstance(section, dict):
        name = section.get("type")
    if not isinstance(name, str) or name not in FILE_TYPES:  # none, or one the section's own validation names
        return data
    data, ignore = {**data}, data.get("ignore", [])
    if FILE_TYPES[name].default in FULL_PRECISION and isinstance(ignore, list) and "*" not in ignore:
        data["ignore"] = [*ignore, "*"]
    if "weights" not in data:  # F16/BF16/F32 quantize no linear: Q8_0's blocks are the format's checks' scheme
        data["weights"] = linear_scheme(name)
    return data


def linear_scheme(name: str):
    """The scheme of the decoder's linears in file type `name`: its default type's (a K mix raises
    some linears above it: formats/gguf.linear_schemes); F16/BF16/F32: Q8_0's, unused."""
    if FILE_TYPES[name].default in K_TYPES:
        return k_scheme(FILE_TYPES[name].default)
    return LEGACY_SCHEMES.get(name, LEGACY_SCHEMES["Q8_0"])


def block_scheme(qtype: str) -> StoredScheme:
    """The scheme the methods quantize a tensor of ggml type `qtype` onto: a K type's super-block
    grid, or a legacy block's fp16 scale (and fp16 minimum as a float zero point)."""
    if qtype in K_TYPES:
        return k_scheme(qtype)
    fields = BLOCK_SCHEMES[qtype]
    return StoredScheme(**fields, float_zero=not fields["symmetric"])


def check_file_type(format_name: str, gguf: GgufOptions | None, weights) -> None:
    """ValueError (one line naming the setting) for a file type the rest of the options contradict."""
    if gguf is None:
        return
    if format_name != "gguf":
        raise ValueError(f"gguf.type {gguf.type} is a GGUF file type: set format gguf, or drop gguf")
    if gguf.full_precision:
        return
    if FILE_TYPES[gguf.type].default in K_TYPES:
        if weights != linear_scheme(gguf.type):
            default = FILE_TYPES[gguf.type].default
            raise ValueError(f"gguf.type {gguf.type} stores {default}'s super-blocks: leave the weight scheme out")
        return
    scheme = LEGACY_SCHEMES[gguf.type]
    given = {key: getattr(weights, key) for key in scheme}
    if given != scheme or weights.type != "int":
        words = f"{scheme['bits']}-bit blocks of {scheme['group_size']}, {'' if scheme['symmetric'] else 'a'}symmetric"
        raise ValueError(f"gguf.type {gguf.type} stores {words}: leave the weight scheme out, or set it so")


def file_type(name: str) -> FileType:
    """The file type of `--gguf-type NAME`; ValueError listing those optkit writes."""
    if name not in FILE_TYPES:
        raise ValueError(f"{name!r} is not a GGUF file type optkit writes: choose one of {', '.join(FILE_TYPES)}")
    return FILE_TYPES[name]


def quantizable(tensor: Tensor) -> bool:
    """tensor_allows_quantization: matrices named *weight, except norms, routers and the like."""
    dims = list(tensor.dims)
    while len(dims) > 1 and dims[-1] == 1:  # ggml_n_dims ignores trailing dimensions of 1
        dims.pop()
    name = tensor.name
    if len(dims) < 2 or not name.endswith("weight") or any(part in name for part in _NOT_QUANTIZED):
        return False
    return name not in ("position_embd.weight", "token_types.weight")


def category(name: str) -> str:
    """tensor_get_category (attn_qkv and attn_kv_b count as attn_v)."""
    if name in ("output.weight", "token_embd.weight", "per_layer_token_embd.weight"):
        return "output" if name == "output.weight" else "token_embd"
    for part, kind in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v")):
        if part in name:
            return kind
    for part in ("attn_k.weight", "attn_q.weight", "attn_output.weight", "ffn_up", "ffn_gate", "ffn_down"):
        if part in name:
            return part.removesuffix(".weight")
    return "other"


def loader_order(tensors: list[Tensor]) -> list[Tensor]:
    """llama_model_loader's weights_map order: by block index (-1 outside blocks), then by name."""

    def key(tensor: Tensor) -> tuple[int, str]:
        match = _BLOCK_INDEX.match(tensor.name)
        return (int(match[1]) if match else -1, tensor.name)

    return sorted(tensors, key=key)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers a `_M` mix raises: the first and last eighth, and every third one between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_types(name: str, tensors: list[Tensor], model: Model, imatrix: bool = False) -> dict[str, str | None]:
    """Each tensor's ggml type in file type `name`, None for one kept as it is stored (1-D tensors,
    norms, routers). `imatrix`: whether an importance matrix is given (one rule of Q4_0 reads it)."""
    ftype = file_type(name)
    ordered = loader_order(tensors)
    counters = _Counters(
        n_attention_wv=sum(category(t.name) == "attn_v" for t in ordered),
        tied=not any(category(t.name) == "output" for t in ordered),
    )
    types: dict[str, str | None] = {}
    for tensor in ordered:
        if not quantizable(tensor):
            types[tensor.name] = None
        elif ftype.default in FULL_PRECISION:
            types[tensor.name] = ftype.default
        else:
            chosen = _mixed_type(ftype, ftype.default, tensor, category(tensor.name), model, counters, imatrix)
            types[tensor.name] = fallback(chosen, tensor.dims[0])
    return types


def fallback(qtype: str, row: int) -> str:
    """tensor_type_fallback: a type whose block divides a row of `row` values (F16 if none does)."""
    if row % BLOCK[qtype] == 0:
        return qtype
    qtype = FALLBACK.get(qtype, qtype)
    return qtype if row % BLOCK[qtype] == 0 else "F16"


@dataclass
class _Counters:
    """quantize_state_impl's counters: the attn_v and ffn_down tensors seen so far."""

    n_attention_wv: int
    tied: bool  # no output.weight: token_embd is the output too
    i_attention_wv: int = 0
    i_ffn_down: int = 0


def _layer(counter: int, tensor: Tensor, model: Model) -> int:
    """layer_info: the running count, or for a mixture of experts the block index in the name."""
    if model.n_expert > 1:
        match = _BLOCK_INDEX.match(tensor.name)
        if match is None or not 0 <= int(match[1]) < model.n_layer:
            raise ValueError(f"{tensor.name}: no block index in [0, {model.n_layer}) in its name")
        return int(match[1])
    return counter


def _mixed_type(
    ftype: FileType, new: str, tensor: Tensor, kind: str, model: Model, counts: _Counters, imatrix: bool
) -> str:
    """llama_tensor_get_type_impl for the file types of FILE_TYPES (before the fallback)."""
    mix, n_layer = ftype.name, model.n_layer
    if kind == "output" or (counts.tied and kind == "token_embd"):
        if tensor.dims[0] % BLOCK[new]:
            return "Q8_0"
        return new if new == "Q8_0" else "Q6_K"
    if kind == "attn_v":
        new = _attn_v_type(mix, new, model, counts)
        counts.i_attention_wv += 1
    elif kind == "attn_k" and model.n_expert == 8:
        new = "Q8_0"
    elif kind == "ffn_down":
        new = _ffn_down_type(mix, new, _layer(counts.i_ffn_down, tensor, model), n_layer, imatrix)
        counts.i_ffn_down += 1
    elif kind == "attn_output":
        if model.n_expert == 8:
            new = "Q5_K" if mix in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M") else new
        else:
            new = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(mix, new)
    return new


def _attn_v_type(mix: str, new: str, model: Model, counts: _Counters) -> str:
    i, n = counts.i_attention_wv, counts.n_attention_wv
    if mix == "Q2_K":
        new = "Q4_K" if model.n_gqa >= 4 else "Q3_K"
    elif mix == "Q3_K_M":
        new = "Q5_K" if i < 2 else "Q4_K"
    elif mix == "Q3_K_L":
        new = "Q5_K"
    elif mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
        new = "Q6_K"
    elif mix == "Q4_K_S" and i < 4:
        new = "Q5_K"
    return "Q8_0" if model.n_expert == 8 else new


def _ffn_down_type(mix: str, new: str, i_layer: int, n_layer: int, imatrix: bool) -> str:
    if mix == "Q2_K":
        return "Q3_K"
    if mix == "Q3_K_M":
        return "Q5_K" if i_layer < n_layer // 16 else "Q4_K"  # (Falcon alone keeps Q3_K off use_more_bits)
    if mix == "Q3_K_L":
        return "Q5_K"
    if mix in ("Q4_K_M", "Q5_K_M"):
        return "Q6_K" if use_more_bits(i_layer, n_layer) else new
    if mix == "Q4_K_S" and i_layer < n_layer // 8:
        return "Q5_K"
    if mix == "Q4_0" and imatrix and i_layer < n_layer // 8:
        return "Q4_1"  # llama.cpp's guard for the first ffn_down layers, only with an importance matrix
    return new
