"""The base model's side of the gate, cached on disk so repeated gates never rerun the base.

Key: sha256 of the base model's files, the exact token windows evaluated (which covers the eval
set's text, the tokenizer and the window length) and k. Stored as safetensors, never pickle.
"""

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from optkit.artifacts import content_sha256
from optkit.cache import cache_dir
from optkit.gate.metrics import Reference


def reference_key(base_dir: Path, windows: torch.Tensor, k: int) -> str:
    digest = hashlib.sha256()
    digest.update(content_sha256(base_dir).encode())
    digest.update(windows.to(torch.int64).contiguous().numpy().tobytes())
    digest.update(f"{tuple(windows.shape)} k={k}".encode())
    return digest.hexdigest()


def _path(key: str) -> Path:
    return cache_dir("references") / f"{key}.safetensors"


def load_reference(key: str) -> Reference | None:
    path = _path(key)
    if not path.exists():
        return None
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError):
        return None  # a damaged cache entry is recomputed, never trusted
    return Reference(tensors["topk_ids"], tensors["topk_logp"], tensors["target_nll"])


def save_reference(key: str, reference: Reference) -> None:
    path = _path(key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = {"topk_ids": reference.topk_ids, "topk_logp": reference.topk_logp, "target_nll": reference.target_nll}
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
    tmp.replace(path)


def load_cached_value(key: str) -> float | None:
    """A number cached beside a reference (the base's task accuracy)."""
    path = cache_dir("references") / f"{key}.json"
    try:
        return float(json.loads(path.read_text())["value"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached_value(key: str, value: float) -> None:
    path = cache_dir("references") / f"{key}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"value": value}))
    tmp.replace(path)
