"""The local compile cache, a store: where a model's warm-up lives on this machine, and reading and
writing its record and torch.compile's cache blob there. `optkit compile` fills it
(runtime/warmup.py, the driver above the engine); the engine looks a model up in it when it starts
(`lookup`). Nothing in it comes from a model directory.

torch.compile's cache artifacts are pickles (torch.compiler.load_cache_artifacts unpickles them),
so they are code: optkit loads them only from this machine's own cache, written by its own
`optkit compile`, and never from a model directory. A `compile/` folder in a model directory
(releases made before this change shipped one) is ignored, with one warning line.

  ROOT/MODEL_ID/KEY/compile.json        what was warmed: torch, device name, batch sizes, timings
  ROOT/MODEL_ID/KEY/torch_compile.bin   torch.compiler.save_cache_artifacts() (--torch-compile)

ROOT is $OPTKIT_CACHE/compile, or the command line's --compile-dir (EngineArgs.compile_dir, which
no recipe or routing config may set: runtime/engine_args.py's FileEngineArgs; never inside the model
directory). It is trusted local state, so ROOT, ROOT/MODEL_ID, ROOT/MODEL_ID/KEY and the blob must
belong to this user and be writable by no one else: anything else is refused in one line before a
byte is read (cache.check_private), and `save_cache` creates them so. MODEL_ID is `model_id`: the
sha256 of what the engine's graphs are built from (config.json and the safetensors). KEY is the
torch version and device name.

torch.compile is off unless asked (EngineArgs.torch_compile, `optkit compile --torch-compile`),
and needs CUDA: on CPU the engine's packed steps change shape every step, so a dynamic=False
compile would recompile per step; it was not measured to help there. So its blob is unpickled
only for a CUDA device (`load_cache`); on any other the engine refuses --torch-compile with
nothing loaded. On CUDA it compiles the model's forward per decode bucket (fixed shapes) right
before that bucket's graph is captured; that path is unverified on a GPU so far. Prefill and
mixed steps always run the eager model.
"""

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from optkit import cache
from optkit.cache import check_private, make_private_dirs
from optkit.errors import OptkitError
from optkit.json_strict import read_object

log = logging.getLogger(__name__)

MANIFEST = "compile.json"
TORCH_CACHE = "torch_compile.bin"
LEGACY_DIR = "compile"  # what releases carried before: ignored


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def cache_key(device: str) -> str:
    """torch version and device name, safe as a file name."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", f"torch-{torch.__version__}-{device_name(device)}")


def model_id(model_dir: Path) -> str:
    """sha256 over the names and sha256 of config.json and the *.safetensors: what the compiled
    graphs depend on. An optkit artifact's digests are read from its optkit.json (cheap: the loader
    has already checked the files against them, modeldir.verify_weights); other directories' files
    are hashed (one read, remembered within the process). So a release and the artifact it was
    packaged from share an id, whatever else (model card, gate report) differs."""
    from optkit.artifacts import content_sha256
    from optkit.manifest import read_manifest
    from optkit.modeldir import weight_files

    listed = (read_manifest(model_dir) or {}).get("files", {})
    digest = hashlib.sha256()
    for file in [model_dir / "config.json", *weight_files(model_dir)]:
        digest.update(f"{file.name}\0{listed.get(file.name) or content_sha256(file)}\n".encode())
    return digest.hexdigest()


def cache_path(model_dir: Path, device: str, compile_dir: str | Path | None = None) -> Path:
    """Where the warm-up of `model_dir` on `device` lives in the local compile cache."""
    return cache_root(model_dir, compile_dir) / model_id(Path(model_dir)) / cache_key(device)


def cache_root(model_dir: Path, compile_dir: str | Path | None = None) -> Path:
    """ROOT: `compile_dir` (--compile-dir), or $OPTKIT_CACHE/compile; refused when it lies inside the
    model directory."""
    root = Path(compile_dir) if compile_dir is not None else cache.cache_root() / "compile"
    model, resolved = Path(model_dir).resolve(), root.resolve()
    if resolved == model or model in resolved.parents:
        raise OptkitError(
            f"compile cache {root} lies inside the model directory {model_dir}: the cache holds code "
            "(torch pickles) and must be this machine's own; use the default $OPTKIT_CACHE/compile"
        )
    return root


def warn_legacy_cache(model_dir: Path) -> None:
    legacy = Path(model_dir) / LEGACY_DIR
    if os.path.lexists(legacy):
        log.warning(
            "ignoring %s: optkit no longer loads compile caches shipped with a model (they can run code); "
            "run `optkit compile %s` on this machine to warm its own",
            legacy,
            model_dir,
        )


def check_entry(directory: Path) -> None:
    """Refuse an entry ROOT/MODEL_ID/KEY whose directories another user owns or may write into."""
    for part in (directory.parents[1], directory.parent, directory):
        check_private(part, "compile cache")


def load_cache(directory: Path, device: str = "cpu") -> dict | None:
    """The warm-up record in the local cache `directory` (None when there is none); loads
    torch.compile's artifacts when they were saved there and `device` is CUDA (torch.compile needs
    it: on any other device the engine refuses --torch-compile, and nothing is unpickled first)."""
    check_entry(directory)
    path = directory / MANIFEST
    if not path.is_file():
        return None
    manifest = read_object(path, "a warm-up record", "delete it and re-run optkit compile")
    manifest["loaded_artifacts"] = False
    blob = directory / TORCH_CACHE
    if manifest.get("torch_compile") and device.startswith("cuda") and blob.is_file():
        check_private(blob, "compile cache file")
        torch.compiler.load_cache_artifacts(blob.read_bytes())  # local, written by this user's optkit compile
        manifest["loaded_artifacts"] = True
    return manifest


@dataclass
class Warmup:
    """A model's entry in the local cache, as `lookup` found it."""

    path: Path
    record: dict  # compile.json, plus loaded_artifacts: whether torch.compile's blob was loaded

    @property
    def note(self) -> str:
        loaded = " (torch.compile artifacts loaded)" if self.record["loaded_artifacts"] else ""
        return f"compile cache {self.path}{loaded}"


def lookup(model_dir: Path, device: str, compile_dir: str | Path | None = None) -> Warmup | None:
    """This machine's warm-up of `model_dir` on `device` (None: not warmed here). Warns about a
    `compile/` shipped in the model directory, which is never read."""
    warn_legacy_cache(model_dir)
    root = cache_root(model_dir, compile_dir)
    if not root.is_dir():
        return None
    check_private(root, "compile cache")
    if not any(root.iterdir()):  # nothing warmed: no need to hash the model for its id
        return None
    path = cache_path(model_dir, device, compile_dir)
    record = load_cache(path, device)
    return Warmup(path, record) if record is not None else None


def save_cache(directory: Path, record: dict, torch_artifacts: bytes | None = None) -> None:
    """Write the warm-up record (and torch.compile's blob) into the local cache `directory`
    (ROOT/MODEL_ID/KEY), its directories and files writable by this user alone."""
    try:
        make_private_dirs(directory, directory.parents[1])
        check_entry(directory)
        if torch_artifacts is not None:
            _write_atomic(directory / TORCH_CACHE, torch_artifacts)
        _write_atomic(directory / MANIFEST, (json.dumps(record, indent=2) + "\n").encode())
    except OSError as e:
        raise OptkitError(
            f"cannot write the compile cache {directory} ({e.strerror}): set OPTKIT_CACHE to a writable directory"
        ) from e


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as file:  # not g+w
        file.write(data)
    tmp.replace(path)
