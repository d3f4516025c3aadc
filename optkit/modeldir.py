"""Model directories: resolve a name or path, check it before use, load it without running code.

Only safetensors are read (never pickle), `trust_remote_code` is never set, and an optkit
artifact's files are checked against the sha256 sums in its `optkit.json` before loading.
"""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from optkit.artifacts import file_sha256
from optkit.errors import OptkitError
from optkit.manifest import MANIFEST

BUNDLED_DIR = Path(__file__).resolve().parent / "zoo" / "models"


def resolve_model_dir(name_or_path: str | Path) -> Path:
    """A bundled reference model by name (`small`, `draft`), or a local directory."""
    from optkit.zoo.specs import SPECS

    path = Path(name_or_path)
    if str(name_or_path) in SPECS and not path.exists():
        path = BUNDLED_DIR / str(name_or_path)
        if not (path / "config.json").exists():
            raise OptkitError(f"reference model {name_or_path!r} is not built: run `optkit zoo build {name_or_path}`")
    check_model_dir(path)
    return path


def check_model_dir(path: Path) -> None:
    if not path.exists():
        raise OptkitError(f"model {path} does not exist: give a model directory or a reference model name")
    if not path.is_dir():
        raise OptkitError(f"model {path} is a file: give the directory that holds config.json")
    if not (path / "config.json").is_file():
        raise OptkitError(f"model {path} has no config.json: give a directory saved with save_pretrained")
    try:
        json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise OptkitError(
            f"{path / 'config.json'} is not valid JSON ({e.msg} at line {e.lineno}): repair or re-create it"
        ) from e
    if not weight_files(path):
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (
            f" (found {', '.join(pickled)}: optkit never loads pickle; re-save with safe_serialization)"
            if pickled
            else ""
        )
        raise OptkitError(f"model {path} has no .safetensors weights{hint}")


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def verify_weights(path: Path) -> None:
    """Every safetensors header parses and fits its file; files match the manifest's sha256."""
    manifest = path / MANIFEST
    expected = json.loads(manifest.read_text()).get("files", {}) if manifest.exists() else {}
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            raise OptkitError(f"{file} is truncated or corrupt ({e}): re-create or re-download it") from e
    for name, digest in expected.items():
        file = path / name
        if not file.exists():
            raise OptkitError(f"{file} is listed in {MANIFEST} but missing: the artifact is incomplete, re-create it")
        if file_sha256(file) != digest:
            raise OptkitError(f"{file} does not match its sha256 in {MANIFEST}: the artifact is corrupt, re-create it")


class TensorReader:
    """Lazy access to the tensors of a model directory (all shards): one tensor read at a time."""

    def __init__(self, path: Path):
        self._files = {}
        for file in weight_files(path):
            with safe_open(file, framework="pt") as f:
                self._files.update(dict.fromkeys(f.keys(), file))

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
    """All tensors of a model directory (every shard), as stored."""
    reader = TensorReader(path)
    return {key: reader.get(key) for key in reader.keys()}


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A causal LM ready for evaluation: plain HF checkpoints through `from_pretrained`; optkit's
    weight-only artifacts through their dequantized weights (the reference semantics); W8A8
    artifacts with int8 linear layers that run int8 matmuls."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.utils import logging as hf_logging

    from optkit.quant.formats import reader_for

    path = resolve_model_dir(name_or_path)
    verify_weights(path)
    hf_logging.disable_progress_bar()  # optkit shows its own progress
    quant_config = read_config(path).get("quantization_config")
    if quant_config is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
        return model.eval()
    fmt = reader_for(quant_config, str(path))
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = read_tensors(path)
    is_w8a8 = getattr(fmt, "is_w8a8", None)  # only compressed-tensors stores int8 activations
    int8_modules = fmt.w8a8_modules(tensors, quant_config) if is_w8a8 and is_w8a8(quant_config) else {}
    for name, module in int8_modules.items():  # W8A8 layers stay int8 and multiply in int8
        model.set_submodule(name, module)

    def in_int8_module(key: str) -> bool:
        return key.rsplit(".", 1)[0] in int8_modules

    if int8_modules:
        state = {k: v for k, v in tensors.items() if not in_int8_module(k)}
    else:
        state = fmt.dequantized_state_dict(tensors, quant_config, dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not in_int8_module(k)]
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise OptkitError(
            f"{path}: weights do not match the config (missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {unexpected[:3]}): re-create the artifact"
        )
    model.tie_weights()
    return model.eval()


def load_tokenizer(name_or_path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(name_or_path))
