"""The local compile cache: what `optkit compile` warms on the machine that serves, and the engine
reuses there. Nothing in it comes from a model directory.

torch.compile's cache artifacts are pickles (torch.compiler.load_cache_artifacts unpickles them),
so they are code: optkit loads them only from this machine's own cache, written by its own
`optkit compile`, and never from a model directory. A `compile/` folder in a model directory
(releases made before this change shipped one) is ignored, with one warning line.

  ROOT/MODEL_ID/KEY/compile.json        what was warmed: torch, device name, batch sizes, timings
  ROOT/MODEL_ID/KEY/torch_compile.bin   torch.compiler.save_cache_artifacts() (--torch-compile)

ROOT is $OPTKIT_CACHE/compile (EngineConfig.compile_dir overrides it; never inside the model
directory). It is trusted local state: keep it writable by you alone. MODEL_ID is `model_id`:
the sha256 of what the engine's graphs are built from (config.json and the safetensors). KEY is
the torch version and device name.

torch.compile is off unless asked (EngineConfig.torch_compile, `optkit compile --torch-compile`),
and needs CUDA: on CPU the engine's packed steps change shape every step, so a dynamic=False
compile would recompile per step; it was not measured to help there. On CUDA it compiles the
model's forward per decode bucket (fixed shapes) right before that bucket's graph is captured;
that path is unverified on a GPU so far. Prefill and mixed steps always run the eager model.
"""

import datetime
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

import torch

from optkit.artifacts import check_writable_dir
from optkit.errors import OptkitError

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
    return _cache_root(model_dir, compile_dir) / model_id(Path(model_dir)) / cache_key(device)


def _cache_root(model_dir: Path, compile_dir: str | Path | None) -> Path:
    from optkit.cache import cache_root

    root = Path(compile_dir) if compile_dir is not None else cache_root() / "compile"
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


def load_cache(directory: Path) -> dict | None:
    """The warm-up record in the local cache `directory` (None when there is none); loads
    torch.compile's artifacts when they were saved there."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OptkitError(f"{path} is not valid JSON ({e}): delete it and re-run optkit compile") from e
    manifest["loaded_artifacts"] = False
    if manifest.get("torch_compile") and (directory / TORCH_CACHE).is_file():
        torch.compiler.load_cache_artifacts((directory / TORCH_CACHE).read_bytes())  # local, written by us
        manifest["loaded_artifacts"] = True
    return manifest


def prepare_runner(engine) -> str:
    """The engine's hook: load this machine's compile cache for the model when there is one, then
    capture the decode graphs (CUDA, unless --enforce-eager). Returns a line saying what was done."""
    from optkit.modeldir import resolve_model_dir
    from optkit.runtime.cuda_graphs import attach_decode_graphs

    config = engine.config
    model_dir = resolve_model_dir(engine.model_path)
    warn_legacy_cache(model_dir)
    root = _cache_root(model_dir, config.compile_dir)
    warmed = root.is_dir() and any(root.iterdir())  # else no need to hash the model for its id
    cache = cache_path(model_dir, config.device, config.compile_dir) if warmed else None
    manifest = load_cache(cache) if cache is not None else None
    use_compile = config.torch_compile or bool(manifest and manifest.get("torch_compile"))
    forward = None
    if use_compile:
        if not config.device.startswith("cuda"):
            raise OptkitError("--torch-compile needs --device cuda: on CPU the engine runs eagerly")
        forward = torch.compile(engine.model, dynamic=False)
    note = attach_decode_graphs(engine.runner, config.max_num_seqs, engine.max_model_len, config.enforce_eager, forward)
    if manifest is not None:
        loaded = " (torch.compile artifacts loaded)" if manifest["loaded_artifacts"] else ""
        note += f"; compile cache {cache}{loaded}"
    return note


def compile_config(batch_sizes: list[int], device: str, dtype: str | None, torch_compile: bool, compile_dir=None):
    """The engine settings `optkit compile` warms: room for the largest batch size."""
    from optkit.runtime.engine import EngineConfig, default_dtype

    return EngineConfig(
        max_num_seqs=max(batch_sizes),
        dtype=dtype or default_dtype(device),
        device=device,
        torch_compile=torch_compile,
        compile_dir=compile_dir,
    )


def compile_model(model: str, batch_sizes: list[int], engine_config, log_line=print) -> dict:
    """Warm the engine at each batch size (capturing the CUDA graphs on CUDA) and write the record
    (and torch.compile's artifacts with --torch-compile) to this machine's compile cache."""
    from optkit.modeldir import resolve_model_dir
    from optkit.runtime.engine import LLMEngine
    from optkit.runtime.sequence import SamplingParams

    path = resolve_model_dir(model)
    root = _cache_root(path, engine_config.compile_dir)
    check_writable_dir(root, "OPTKIT_CACHE" if engine_config.compile_dir is None else "compile_dir")
    start = time.perf_counter()
    engine = LLMEngine(path, engine_config)  # checks the files against optkit.json, which model_id trusts
    load_seconds = time.perf_counter() - start
    directory = cache_path(path, engine_config.device, engine_config.compile_dir)
    log_line(engine.cuda_graphs_note)
    warmup = {}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for batch_size in batch_sizes:
        t0 = time.perf_counter()
        engine.generate([[1 + i % 7] * 8 for i in range(batch_size)], params)
        warmup[str(batch_size)] = time.perf_counter() - t0
    saved = torch.compiler.save_cache_artifacts() if engine_config.torch_compile else None
    manifest = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_id": directory.parent.name,
        "key": directory.name,
        "torch": torch.__version__,
        "device": engine_config.device,
        "device_name": device_name(engine_config.device),
        "dtype": engine_config.dtype,
        "batch_sizes": batch_sizes,
        "max_num_seqs": engine_config.max_num_seqs,
        "cuda_graphs": engine.runner.graphs.buckets if engine.runner.graphs is not None else None,
        "torch_compile": engine_config.torch_compile,
        "torch_compile_cache": saved is not None,
        "load_seconds": load_seconds,  # model load plus graph capture (and compilation)
        "warmup_seconds": warmup,
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if saved is not None:
            _write_atomic(directory / TORCH_CACHE, saved[0])
        _write_atomic(directory / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    except OSError as e:
        raise OptkitError(
            f"cannot write the compile cache {directory} ({e.strerror}): set OPTKIT_CACHE to a writable directory"
        ) from e
    return {**manifest, "path": str(directory)}


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)
