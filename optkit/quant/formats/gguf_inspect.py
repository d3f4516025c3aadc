"""`optkit inspect model.gguf`: what a llama.cpp user asks of a file, as data (the CLI renders it):
the architecture and its hyperparameters, the tokenizer, whether a chat template is there, the
tensors by type (count, parameters, bytes, bits per weight) and by shape, and optkit's manifest when
optkit wrote the file."""

import json
import re
from pathlib import Path

from optkit.quant.formats.gguf_check import open_checked

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


def _value(reader, key: str):
    entry = reader.fields.get(key)
    return None if entry is None else entry.contents()


def summary(path: str | Path) -> dict:
    """The file's description; raises OptkitError (one line) when its header does not parse."""
    path = Path(path)
    header, reader = open_checked(path)  # a broken file is named here, in one line
    arch = _value(reader, "general.architecture")
    tokens, merges = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.merges")
    template = _value(reader, "tokenizer.chat_template")
    manifest = _value(reader, "optkit.manifest")
    tensors = [
        {"name": t.name, "type": t.tensor_type.name, "shape": [int(d) for d in t.shape], "bytes": int(t.n_bytes)}
        for t in reader.tensors
    ]
    return {
        "file": str(path),
        "size_bytes": header.file_size,
        "gguf_version": header.version,
        "architecture": arch,
        "name": _value(reader, "general.name"),
        "file_type": _file_type(_value(reader, "general.file_type")),
        "quantized_by": _value(reader, "general.quantized_by"),
        "hyperparameters": {
            key: value for key in HYPERPARAMETERS if (value := _value(reader, f"{arch}.{key}")) is not None
        },
        "tokenizer": {
            "model": _value(reader, "tokenizer.ggml.model"),
            "pre": _value(reader, "tokenizer.ggml.pre"),
            "vocab_size": len(tokens.data) if tokens is not None else None,
            "merges": len(merges.data) if merges is not None else None,
            "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _value(reader, "tokenizer.ggml.eos_token_id"),
            "add_bos_token": _value(reader, "tokenizer.ggml.add_bos_token"),
        },
        "chat_template": {"present": template is not None, "chars": len(template) if template else 0},
        "metadata_keys": len(header.keys),
        "parameters": sum(_elements(t["shape"]) for t in tensors),
        "types": by_type(tensors),
        "groups": by_shape(tensors),
        "tensors": tensors,
        "optkit": json.loads(manifest) if manifest else None,
    }


def _file_type(value) -> str | None:
    import gguf

    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_") if value is not None else None
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
