"""What `optkit compile` stores and the engine loads: a warm-up record and, with --torch-compile,
torch.compile's cache artifacts, in DIR/compile/ (DIR: the model directory unless --out says).

  compile/compile.json     what was compiled: torch version, device name, batch sizes, timings
  compile/KEY.bin          torch.compiler.save_cache_artifacts(), KEY = torch version + device name

torch.compile is off unless asked (EngineConfig.torch_compile, `optkit compile --torch-compile`),
and needs CUDA: on CPU the engine's packed steps change shape every step, so a dynamic=False
compile would recompile per step; it was not measured to help there. On CUDA it compiles the
model's forward per decode bucket (fixed shapes) right before that bucket's graph is captured;
that path is unverified on a GPU so far. Prefill and mixed steps always run the eager model.
"""

import datetime
import json
import logging
import re
import time
from pathlib import Path

import torch

from optkit.errors import OptkitError

log = logging.getLogger(__name__)

COMPILE_DIR = "compile"
MANIFEST = "compile.json"


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def cache_key(device: str) -> str:
    """torch version and device name, safe as a file name."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", f"torch-{torch.__version__}-{device_name(device)}")


def find_cache(model_dir: Path, compile_dir: str | Path | None) -> Path | None:
    """DIR/compile of an explicit compile_dir, else the model's own compile/, when it holds a manifest."""
    base = Path(compile_dir) if compile_dir is not None else model_dir
    for candidate in (base / COMPILE_DIR, base):
        if (candidate / MANIFEST).is_file():
            return candidate
    if compile_dir is not None:
        raise OptkitError(f"--compile-dir {compile_dir}: no {COMPILE_DIR}/{MANIFEST} there: run `optkit compile` first")
    return None


def load_cache(directory: Path, device: str) -> dict:
    """The manifest; loads the torch.compile artifacts when they were made for this torch and device."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except json.JSONDecodeError as e:
        raise OptkitError(f"{directory / MANIFEST} is not valid JSON ({e.msg}): re-run optkit compile") from e
    manifest["loaded_artifacts"] = False
    artifact = manifest.get("artifacts")
    if artifact and manifest.get("key") == cache_key(device):
        torch.compiler.load_cache_artifacts((directory / artifact).read_bytes())
        manifest["loaded_artifacts"] = True
    elif artifact:
        key, here = manifest.get("key"), cache_key(device)
        log.warning("%s was compiled for %s, this is %s: compiling afresh", directory, key, here)
    return manifest


def prepare_runner(engine) -> str:
    """The engine's hook: load a compile cache when present, then capture the decode graphs (CUDA,
    unless --enforce-eager). Returns a line saying what was done."""
    from optkit.modeldir import resolve_model_dir
    from optkit.runtime.cuda_graphs import attach_decode_graphs

    config = engine.config
    cache = find_cache(resolve_model_dir(engine.model_path), config.compile_dir)
    manifest = load_cache(cache, config.device) if cache is not None else None
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


def compile_config(batch_sizes: list[int], device: str, dtype: str | None, torch_compile: bool):
    """The engine settings `optkit compile` warms: room for the largest batch size."""
    from optkit.runtime.engine import EngineConfig, default_dtype

    return EngineConfig(
        max_num_seqs=max(batch_sizes),
        dtype=dtype or default_dtype(device),
        device=device,
        torch_compile=torch_compile,
    )


def compile_model(model: str, out: Path | None, batch_sizes: list[int], engine_config, log_line=print) -> dict:
    """Warm the engine at each batch size (capturing the CUDA graphs on CUDA) and write the manifest
    (and torch.compile's artifacts with --torch-compile) to OUT/compile/."""
    from optkit.modeldir import resolve_model_dir
    from optkit.runtime.engine import LLMEngine
    from optkit.runtime.sequence import SamplingParams

    path = resolve_model_dir(model)
    directory = (out if out is not None else path) / COMPILE_DIR
    start = time.perf_counter()
    engine = LLMEngine(path, engine_config)
    load_seconds = time.perf_counter() - start
    log_line(engine.cuda_graphs_note)
    warmup = {}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for batch_size in batch_sizes:
        t0 = time.perf_counter()
        engine.generate([[1 + i % 7] * 8 for i in range(batch_size)], params)
        warmup[str(batch_size)] = time.perf_counter() - t0
    directory.mkdir(parents=True, exist_ok=True)
    key = cache_key(engine_config.device)
    artifact = None
    if engine_config.torch_compile:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            artifact = f"{key}.bin"
            (directory / artifact).write_bytes(saved[0])
    manifest = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "key": key,
        "torch": torch.__version__,
        "device": engine_config.device,
        "device_name": device_name(engine_config.device),
        "dtype": engine_config.dtype,
        "batch_sizes": batch_sizes,
        "max_num_seqs": engine_config.max_num_seqs,
        "cuda_graphs": engine.runner.graphs.buckets if engine.runner.graphs is not None else None,
        "torch_compile": engine_config.torch_compile,
        "artifacts": artifact,
        "load_seconds": load_seconds,  # model load plus graph capture (and compilation)
        "warmup_seconds": warmup,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return {**manifest, "path": str(directory)}
