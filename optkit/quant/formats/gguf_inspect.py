"""`optkit inspect model.gguf`: what a llama.cpp user asks of a file, as data (the CLI renders it):
the architecture and its hyperparameters, the tokenizer, whether a chat template is there, the
tensors by type (count, parameters, bytes, bits per weight) and by shape, and optkit's manifest when
optkit wrote the file."""

import math
import re
from pathlib import Path

from optkit.quant.formats.gguf_check import open_checked
from optkit.quant.formats.gguf_header import ARRAY, Header
from optkit.quant.formats.gguf_hparams import architecture, optkit_manifest
from optkit.quant.formats.gguf_tensors import byte_count, type_name

HYPERPARAMETERS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
)


def _scalar(header: Header, key: str):
    """A metadata value as inspect shows it: an array by its length, never its items."""
    entry = header.metadata.get(key)
    if entry is None:
        return None
    if entry.type_id == ARRAY:
        return f"[{len(entry.value)} items]"
    if isinstance(entry.value, float) and not math.isfinite(entry.value):
        return str(entry.value)  # JSON has no NaN
    return entry.value


def _count(header: Header, key: str) -> int | None:
    entry = header.metadata.get(key)
    return len(entry.value) if entry is not None and entry.type_id == ARRAY else None


def summary(path: str | Path) -> dict:
    """The file's description; raises OptkitError (one line) when its header does not parse."""
    path = Path(path)
    header = open_checked(path)  # a broken file is named here, in one line
    arch = architecture(header)
    template = header.value("tokenizer.chat_template")
    tensors = [
        {"name": t.name, "type": type_name(t.type_id), "shape": list(t.dims), "bytes": byte_count(t)}
        for t in header.tensors
    ]
    return {
        "file": str(path),
        "size_bytes": header.file_size,
        "gguf_version": header.version,
        "architecture": _scalar(header, "general.architecture"),
        "name": _scalar(header, "general.name"),
        "file_type": _file_type(_scalar(header, "general.file_type")),
        "quantized_by": _scalar(header, "general.quantized_by"),
        "hyperparameters": {
            key: value for key in HYPERPARAMETERS if (value := _scalar(header, f"{arch}.{key}")) is not None
        }
        if arch is not None
        else {},
        "tokenizer": {
            "model": _scalar(header, "tokenizer.ggml.model"),
            "pre": _scalar(header, "tokenizer.ggml.pre"),
            "vocab_size": _count(header, "tokenizer.ggml.tokens"),
            "merges": _count(header, "tokenizer.ggml.merges"),
            "bos_token_id": _scalar(header, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _scalar(header, "tokenizer.ggml.eos_token_id"),
            "add_bos_token": _scalar(header, "tokenizer.ggml.add_bos_token"),
        },
        "chat_template": {
            "present": template is not None,
            "chars": len(template) if isinstance(template, str) else 0,
        },
        "metadata_keys": len(header.metadata),
        "parameters": sum(_elements(t["shape"]) for t in tensors),
        "types": by_type(tensors),
        "groups": by_shape(tensors),
        "tensors": tensors,
        "optkit": optkit_manifest(header),
    }


def _file_type(value) -> str | None:
    import gguf

    if not isinstance(value, int) or isinstance(value, bool):
        return None if value is None else str(value)
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(value)


def _elements(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def by_type(tensors: list[dict]) -> list[dict]:
    """One row per ggml type: tensors, parameters, bytes and bits per weight (bytes·8 / parameters)."""
    rows: dict[str, dict] = {}
    for t in tensors:
        row = rows.setdefault(t["type"], {"type": t["type"], "tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += _elements(t["shape"])
        row["bytes"] += t["bytes"]
    for row in rows.values():
        row["bits_per_weight"] = round(8 * row["bytes"] / max(row["parameters"], 1), 3)
    return sorted(rows.values(), key=lambda r: -r["bytes"])


def by_shape(tensors: list[dict]) -> list[dict]:
    """Tensors grouped as `blk.*.attn_q.weight` with one type and shape: a model's dozens of blocks as
    a few lines (a group whose blocks differ in type, as llama.cpp's mixes do, is several lines)."""
    rows: dict[tuple, dict] = {}
    for t in tensors:
        pattern = re.sub(r"^blk\.\d+\.", "blk.*.", t["name"])
        key = (pattern, t["type"], tuple(t["shape"]))
        row = rows.setdefault(key, {"name": pattern, "type": t["type"], "shape": t["shape"], "count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += t["bytes"]
    return list(rows.values())
