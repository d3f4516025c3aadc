"""Model directories: resolve a name or path, check it before use, load it without running code.

Only safetensors are read (never pickle), `trust_remote_code` is never set, and an optkit
artifact's files are checked against the sha256 sums in its `optkit.json` before loading (each name
confined to the directory: manifest.confined_file). A `compile/` in the directory is never read
(runtime/compile_cache.py).
"""

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from optkit.artifacts import file_sha256
from optkit.errors import OptkitError
from optkit.hf_config import check_config
from optkit.json_strict import read_json, read_object
from optkit.manifest import MANIFEST, confined_file, read_manifest

BUNDLED_DIR = Path(__file__).resolve().parent / "zoo" / "models"


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """A bundled reference model by name (`small`, `draft`: a built folder of BUNDLED_DIR), or a
    local directory. (The zoo, which builds them, sits above this module: only the folder is read.)"""
    path = Path(name_or_path)
    bundled = BUNDLED_DIR / str(name_or_path)
    if not path.exists() and path.name == str(name_or_path) and (bundled / "config.json").is_file():
        path = bundled
    check_model_dir(path)
    return path


def bundled_models() -> list[str]:
    return sorted(p.parent.name for p in BUNDLED_DIR.glob("*/config.json"))


def check_model_dir(path: Path) -> None:
    if not path.exists():
        raise OptkitError(
            f"model {path} does not exist: give a model directory or a reference model name "
            f"({', '.join(bundled_models())}; `optkit zoo build NAME` builds one)"
        )
    if not path.is_dir():
        raise OptkitError(f"model {path} is a file: give the directory that holds config.json")
    if not (path / "config.json").is_file():
        raise OptkitError(f"model {path} has no config.json: give a directory saved with save_pretrained")
    read_config(path)  # every size in it checked before anything is built from it
    if not weight_files(path):
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        other = sorted(p.name for p in path.glob("*.safetensors"))
        if other:
            raise OptkitError(
                f"model {path} has no model.safetensors or {INDEX} (found {', '.join(other)}): "
                "name the weights as save_pretrained does"
            )
        hint = (
            f" (found {', '.join(pickled)}: optkit never loads pickle; re-save with safe_serialization)"
            if pickled
            else ""
        )
        raise OptkitError(f"model {path} has no .safetensors weights{hint}")


INDEX = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files a loader reads, as transformers picks them: `model.safetensors`, else
    the shards `model.safetensors.index.json` names; in an optkit artifact each must be listed in
    its optkit.json, and a weight file (or index) there that it does not list is refused rather
    than ignored. Every name is confined to the directory (no symlink out of it); [] for none."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is not None:
        for entry in sorted(path.iterdir()):
            if (entry.name.endswith(".safetensors") or entry.name == INDEX) and entry.name not in manifest["files"]:
                raise OptkitError(
                    f"{entry} is not listed in {MANIFEST}: optkit loads only the files an artifact's manifest "
                    "lists; remove it or re-create the artifact"
                )
    if os.path.lexists(path / "model.safetensors"):
        names = ["model.safetensors"]
    elif os.path.lexists(path / INDEX):
        names = _indexed_shards(path)
    elif manifest is not None:  # an optkit artifact names its weight files in its manifest alone
        names = sorted(name for name in manifest["files"] if "/" not in name and name.endswith(".safetensors"))
    else:
        return []
    files = []
    for name in names:
        if confined_file(path, name, INDEX if name != "model.safetensors" else None) is None:
            raise OptkitError(
                f"{path / name} is missing: the model directory is incomplete, re-create or re-download it"
            )
        files.append(path / name)
    return files


def _indexed_shards(path: Path) -> list[str]:
    """The file names `model.safetensors.index.json`'s weight_map names, each once."""
    index = confined_file(path, INDEX)
    weight_map = read_object(index, "a shard index").get("weight_map") if index is not None else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise OptkitError(f'{path / INDEX}: "weight_map" must map tensor names to file names: repair or re-create it')
    return sorted(set(weight_map.values()))


def _tensor_files(path: Path) -> dict[str, Path]:
    """Which weight file holds each tensor; a tensor in two files is refused (neither may override
    the other)."""
    files: dict[str, Path] = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key in files:
                    raise OptkitError(
                        f"tensor {key} is in both {files[key].name} and {file.name} in {path}: "
                        "a checkpoint stores each tensor once; re-create or re-download it"
                    )
                files[key] = file
    return files


def read_config(path: Path) -> dict:
    """config.json as a dict whose sizes are all usable (hf_config.check_config), else one OptkitError."""
    file = path / "config.json"
    config = read_json(file, "a model's config")
    return check_config(config, str(file))


def verify_weights(path: Path) -> None:
    """Every safetensors header parses and fits its file, each tensor is in one file only; files
    match the manifest's sha256."""
    expected = (read_manifest(path) or {}).get("files", {})
    for file in weight_files(path):
        if not file.is_file():  # a FIFO would block the read
            raise OptkitError(f"{file} is not a regular file: optkit reads weights only from regular files")
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            raise OptkitError(f"{file} is truncated or corrupt ({e}): re-create or re-download it") from e
    _tensor_files(path)
    for name, digest in expected.items():
        file = confined_file(path, name, MANIFEST)
        if file is None:
            raise OptkitError(
                f"{path / name} is listed in {MANIFEST} but missing: the artifact is incomplete, re-create it"
            )
        if file_sha256(file) != digest:
            raise OptkitError(
                f"{path / name} does not match its sha256 in {MANIFEST}: the artifact is corrupt, re-create it"
            )


class TensorReader:
    """Lazy access to the tensors of a model directory (all shards): one tensor read at a time."""

    def __init__(self, path: Path):
        self._files = _tensor_files(path)

    def keys(self) -> list[str]:
        return list(self._files)

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def get(self, key: str) -> torch.Tensor:
        with safe_open(self._files[key], framework="pt") as f:
            return f.get_tensor(key)

    def get_prefixed(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors under `prefix` (e.g. "model.layers.3."), keyed by the rest of their name."""
        return {k.removeprefix(prefix): self.get(k) for k in self._files if k.startswith(prefix)}


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model directory (every shard), as stored: each file opened once (an open
    parses the header; once per tensor, that was half of an artifact's load: docs/results.md)."""
    by_file: dict[Path, list[str]] = {}
    for key, file in _tensor_files(path).items():
        by_file.setdefault(file, []).append(key)
    tensors = {}
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in keys})
    return tensors


def load_tokenizer(name_or_path: str | Path):
    """The model directory's tokenizer, by the classes transformers ships: code that its
    tokenizer_config.json or config.json names in `auto_map` is never run (trust_remote_code is
    False, so transformers neither runs it nor asks on the terminal whether to), and a tokenizer
    that needs it is refused in one line."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(name_or_path)
    _check_tokenizer_config(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except ValueError as e:
        if "trust_remote_code" not in str(e) and _model_file_alone(path):
            raise OptkitError(
                f"{path}: transformers reads a tokenizer.model without a tokenizer.json only with protobuf installed "
                "(pip install protobuf): install it, or add the tokenizer.json transformers saves for the model"
            ) from e
        if "trust_remote_code" not in str(e):
            raise
        raise OptkitError(
            f"{path}: its tokenizer is custom code (auto_map {_auto_map(path)}), and optkit never runs code "
            "from a model directory: give a tokenizer transformers ships (tokenizer_class) or a tokenizer.json"
        ) from e


def _model_file_alone(path: Path) -> bool:
    """A SentencePiece tokenizer.model without the tokenizer.json transformers would read instead."""
    return (path / "tokenizer.model").is_file() and not (path / "tokenizer.json").is_file()


def _check_tokenizer_config(path: Path) -> None:
    """tokenizer_config.json, where there is one, is a JSON object whose class names transformers can read."""
    file = path / TOKENIZER_CONFIG
    if not file.is_file():
        return
    config = read_object(file, "tokenizer settings")
    for key, kind, name in (("tokenizer_class", str, "a class name"), ("auto_map", dict, "an object")):
        if config.get(key) is not None and not isinstance(config[key], kind):
            raise OptkitError(f"{file}: {key} is not {name}: repair or re-create it")


TOKENIZER_CONFIG = "tokenizer_config.json"


def _auto_map(path: Path) -> str:
    """The custom tokenizer classes tokenizer_config.json names, for an error line."""
    try:
        names = json.loads((path / TOKENIZER_CONFIG).read_text(encoding="utf-8")).get("auto_map")
    except (OSError, ValueError, AttributeError, RecursionError):
        names = None
    text = repr(names)
    return text if len(text) <= 80 else text[:77] + "..."
