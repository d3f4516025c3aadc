"""Which engine runs the artifact in the gate: `optkit eval --engine`, a recipe's `gate.engine`.

transformers  the artifact as a transformers model (the default for a directory)
optkit        optkit's runtime: paged attention and its KV cache (--kv-cache-dtype alone implies it)
vllm          vLLM's kernels, in vLLM's own venv (gate/vllm_model.py; the python from --vllm-python
              or OPTKIT_VLLM_PYTHON, never from a recipe); --kv-cache-dtype fp8 maps to vLLM's
llama.cpp     a single-file artifact's runtime: its format names it (GGUF), and no other engine runs it
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from optkit.errors import OptkitError

ENGINES = ("transformers", "optkit", "vllm", "llama.cpp")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
VLLM_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8"}  # vLLM has no int8 KV cache


def choose_engine(
    artifact: str | Path, engine: str | None, *, kv_cache_dtype: str | None = None, task: str | None = None
) -> str:
    """The engine that runs `artifact`, from --engine (None: the artifact's default), checked
    against the other flags; each conflict is one line naming what to change."""
    from optkit.quant.formats import file_format

    if engine is not None and engine not in ENGINES:
        raise OptkitError(f"unknown --engine {engine!r}: choose {', '.join(ENGINES)}")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise OptkitError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}: choose {', '.join(KV_CACHE_DTYPES)}")
    one_file = file_format(artifact)
    runtime = one_file.runtime if one_file else None
    chosen = engine or runtime or ("optkit" if kv_cache_dtype is not None else "transformers")
    if runtime is not None and chosen != runtime:
        raise OptkitError(f"{artifact} is a {one_file.NAME} file, which {runtime} runs: drop --engine {chosen}")
    if runtime is None and chosen == "llama.cpp":
        raise OptkitError("--engine llama.cpp runs .gguf files: give one (optkit quantize --format gguf)")
    if kv_cache_dtype is not None and chosen not in ("optkit", "vllm"):
        raise OptkitError(
            f"--kv-cache-dtype sets a paged KV cache, which --engine {chosen} has not: use --engine optkit or vllm"
        )
    if kv_cache_dtype is not None and chosen == "vllm" and kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
        raise OptkitError(f"vLLM has no {kv_cache_dtype} KV cache: give --kv-cache-dtype fp8 or auto")
    if task is not None and chosen in ("optkit", "vllm"):
        raise OptkitError(
            f"--engine {chosen} scores perplexity and KLD only: drop --task, "
            "or gate the task with --engine transformers"
        )
    return chosen


def paged_model(artifact: str | Path, kv_cache_dtype: str):
    """The artifact run by optkit's runtime (paged attention, that KV cache), fp32."""
    from optkit.models.loader import load_runtime_model
    from optkit.models.paged_lm import PagedLM

    return PagedLM(load_runtime_model(artifact, prepare=False), kv_cache_dtype)  # windows: no decode kernel


@contextmanager
def gate_engine(
    artifact: str | Path,
    engine: str | None,
    *,
    kv_cache_dtype: str | None = None,
    task: str | None = None,
    seq_len: int = 256,
    vllm_python: str | Path | None = None,
) -> Iterator[tuple[object, dict | None]]:
    """(artifact model, what the report says of it) for `optkit.gate.evaluate(artifact_model=...,
    engine=...)`; (None, None) where evaluate runs the artifact itself (transformers, llama.cpp).
    A vLLM worker is shut down on leaving."""
    chosen = choose_engine(artifact, engine, kv_cache_dtype=kv_cache_dtype, task=task)
    if chosen == "optkit":
        kv = kv_cache_dtype or "auto"
        yield paged_model(artifact, kv), {"name": "optkit", "dtype": "float32", "kv_cache_dtype": kv}
    elif chosen == "vllm":
        from optkit.engines.vllm import vllm_python as find_python
        from optkit.gate.vllm_model import VllmModel
        from optkit.modeldir import resolve_model_dir

        python = find_python(vllm_python)
        model = VllmModel(
            resolve_model_dir(artifact),
            python,
            seq_len=seq_len,
            kv_cache_dtype=VLLM_KV_CACHE_DTYPES[kv_cache_dtype or "auto"],
        )
        try:
            yield model, model.engine
        finally:
            model.close()
    else:
        yield None, None
