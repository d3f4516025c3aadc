"""The warm-up driver of `optkit compile` and `optkit run`'s compile stage: starts an engine, runs it at
each decode batch size (capturing the CUDA graphs on CUDA) and writes what was warmed into this
machine's compile cache (runtime/compile_cache.py, the store). It sits above the engine: the engine
only looks its model up in the cache when it starts.
"""

import datetime
import time
from collections.abc import Callable
from pathlib import Path

import torch

from optkit.artifacts import check_writable_dir
from optkit.cache import check_private
from optkit.modeldir import resolve_model_dir
from optkit.runtime import compile_cache
from optkit.runtime.engine import LLMEngine
from optkit.runtime.engine_args import EngineConfig
from optkit.runtime.sequence import SamplingParams


def compile_model(
    model: str | Path, batch_sizes: list[int], config: EngineConfig, log_line: Callable[[str], None] = print
) -> dict:
    """Warm the engine at each batch size and write the record (and torch.compile's artifacts with
    torch_compile) to this machine's compile cache; the record, with the entry's `path`."""
    path = resolve_model_dir(model)
    root = compile_cache.cache_root(path, config.compile_dir)
    check_writable_dir(root, "OPTKIT_CACHE" if config.compile_dir is None else "--compile-dir")
    check_private(root, "compile cache")  # before the model loads: the entry is checked again on writing
    start = time.perf_counter()
    engine = LLMEngine(path, config)  # checks the files against optkit.json, which model_id trusts
    load_seconds = time.perf_counter() - start
    directory = compile_cache.cache_path(path, config.device, config.compile_dir)
    log_line(engine.cuda_graphs_note)
    warmup = {}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for batch_size in batch_sizes:
        t0 = time.perf_counter()
        engine.generate([[1 + i % 7] * 8 for i in range(batch_size)], params)
        warmup[str(batch_size)] = time.perf_counter() - t0
    saved = torch.compiler.save_cache_artifacts() if config.torch_compile else None
    graphs = engine.runner.graphs
    record = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_id": directory.parent.name,
        "key": directory.name,
        "torch": torch.__version__,
        "device": config.device,
        "device_name": compile_cache.device_name(config.device),
        "dtype": config.dtype,
        "batch_sizes": batch_sizes,
        "max_num_seqs": config.max_num_seqs,
        "cuda_graphs": graphs.buckets if graphs is not None else None,
        "torch_compile": config.torch_compile,
        "torch_compile_cache": saved is not None,
        "load_seconds": load_seconds,  # model load plus graph capture (and compilation)
        "warmup_seconds": warmup,
    }
    compile_cache.save_cache(directory, record, saved[0] if saved is not None else None)
    return {**record, "path": str(directory)}
