"""The base model's side of the gate, cached on disk so repeated gates never rerun the base.

One entry per window: its key is the sha256 of the base model's files, k and the window's own
tokens (which cover the eval set's text, the tokenizer and the window length), so a gate that
draws the windows in another order (`--sequential`), a subset of them (`--max-windows`) or more of
them finds each window it has seen before. Stored as safetensors, never pickle; entries of the
older whole-set layout are simply not found. A task's base answers are keyed by the base model and
k (`ReferenceKey.base`) and the task's questions.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from optkit.artifacts import content_sha256
from optkit.cache import cache_dir
from optkit.gate.metrics import Reference

FIELDS = ("topk_ids", "topk_logp", "target_nll")


@dataclass(frozen=True)
class ReferenceKey:
    base: str  # the base model's files and k
    windows: tuple[str, ...]  # one key per window, in the windows' order

    def select(self, index) -> "ReferenceKey":
        """The keys of the windows at `index` (a slice, or positions)."""
        if isinstance(index, slice):
            return ReferenceKey(self.base, self.windows[index])
        return ReferenceKey(self.base, tuple(self.windows[int(i)] for i in index))


def reference_key(base_dir: Path, windows: torch.Tensor, k: int) -> ReferenceKey:
    """windows [W, T] int -> the keys of the base's top-k for each window."""
    base = hashlib.sha256(f"{content_sha256(base_dir)} k={k}".encode()).hexdigest()
    rows = windows.to(torch.int64).contiguous().numpy()
    return ReferenceKey(base, tuple(hashlib.sha256(base.encode() + row.tobytes()).hexdigest() for row in rows))


def _path(window_key: str) -> Path:
    return cache_dir("references", "windows") / f"{window_key}.safetensors"


def _load_window(window_key: str) -> Reference | None:
    path = _path(window_key)
    if not path.exists():
        return None
    try:
        tensors = load_file(path)
        reference = Reference(*(tensors[f] for f in FIELDS))
    except (SafetensorError, OSError, KeyError):
        return None  # a damaged cache entry is recomputed, never trusted
    ids, logp, nll = reference.topk_ids, reference.topk_logp, reference.target_nll
    if ids.dim() != 2 or ids.shape != logp.shape or nll.shape != ids.shape[:1]:
        return None
    return reference


def load_reference(key: ReferenceKey) -> Reference | None:
    """The base's top-k for every window of `key` ([W, T-1, k]), or None if any is missing."""
    parts = []
    for window_key in key.windows:
        part = _load_window(window_key)
        if part is None or (parts and part.topk_ids.shape != parts[0].topk_ids.shape):
            return None
        parts.append(part)
    if not parts:
        return None
    return Reference(*(torch.stack([getattr(p, f) for p in parts]) for f in FIELDS))


def save_reference(key: ReferenceKey, reference: Reference) -> None:
    """One entry per window of `key`, from the rows of `reference` [W, T-1, k]."""
    if len(key.windows) != reference.topk_ids.shape[0]:
        raise ValueError(f"{len(key.windows)} keys for {reference.topk_ids.shape[0]} windows")
    for row, window_key in enumerate(key.windows):
        path = _path(window_key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({f: getattr(reference, f)[row].contiguous() for f in FIELDS}, tmp)
        tmp.replace(path)


def load_cached_value(key: str):
    """A JSON value cached beside a reference (the base's answers to a task, 0/1 per question);
    the caller checks its shape."""
    path = cache_dir("references") / f"{key}.json"
    try:
        return json.loads(path.read_text())["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_cached_value(key: str, value) -> None:
    path = cache_dir("references") / f"{key}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"value": value}))
    tmp.replace(path)
