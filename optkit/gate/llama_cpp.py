"""llama.cpp as the gate's artifact model: the logits of every position of a window, computed by
llama.cpp itself through llama-cpp-python (the optional extra `optkit[gguf]`), so a .gguf is judged
by the runtime that will serve it (its CPU dot products quantize activations to 8 bits)."""

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from optkit.errors import OptkitError
from optkit.gate.llama_cpp_buffers import configure_llama_cpp
from optkit.gate.llama_cpp_probe import probe_load

INSTALL_HINT = "pip install 'optkit[gguf]' (llama-cpp-python, built from source)"


def idle_cores() -> int:
    """The cores no other process keeps busy (this one's own share counted free), at least 1.

    ggml's threads meet at a spinning barrier after every operation: when the cores are shared, one
    descheduled thread stalls the rest: on 2 shared cores one thread ran several times faster than two
    (docs/results.md, "Numbers moved out of the code").
    The thread count does not change llama.cpp's logits (each row's dot product is one thread's)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(cores, cores - round(busy) + 1))


def _threads_from_env() -> int | None:
    value = os.environ.get("OPTKIT_LLAMA_CPP_THREADS")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise OptkitError(f"OPTKIT_LLAMA_CPP_THREADS={value!r}: give a positive number of threads, or unset it")
    return int(value)


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppModel:
    """`model(tokens).logits` as a transformers model answers it: tokens [B, T] -> logits [B, T, V]
    (float32), each row evaluated from an empty context. n_threads: llama.cpp's threads (None: the
    environment's OPTKIT_LLAMA_CPP_THREADS, else `idle_cores()` when the file is loaded).
    The file is loaded here only after llama.cpp loaded it in a child process (llama_cpp_probe.py)."""

    def __init__(self, path: str | Path, n_ctx: int = 2048, n_threads: int | None = None):
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise OptkitError(f"evaluating a .gguf runs llama.cpp: {INSTALL_HINT}") from e
        configure_llama_cpp()
        self.n_ctx = n_ctx
        self.n_threads = n_threads or _threads_from_env() or idle_cores()
        problem = probe_load(path, n_ctx=n_ctx)  # in a child: a file that makes llama.cpp abort ends only it
        if problem:
            raise OptkitError(f"{path}: {problem}")
        try:
            self.llm = Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=n_ctx,
                n_ubatch=n_ctx,
                n_threads=self.n_threads,
                n_threads_batch=self.n_threads,
                logits_all=True,
                verbose=False,
            )
        except (ValueError, RuntimeError) as e:
            raise OptkitError(f"llama.cpp cannot load {path} ({e}): re-create it with optkit quantize") from e

    @property
    def vocab_size(self) -> int:
        return self.llm.n_vocab()

    def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
        """llama.cpp's own token ids for `text`, special tokens in the text parsed as transformers does."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def close(self) -> None:
        """Free llama.cpp's model and context now (not in a destructor at interpreter exit)."""
        self.llm.close()

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor) -> SimpleNamespace:
        rows = []
        for row in tokens.tolist():
            if len(row) > self.n_ctx:
                raise OptkitError(f"a sequence of {len(row)} tokens exceeds llama.cpp's context of {self.n_ctx}")
            self.llm.reset()
            self.llm.eval(row)
            rows.append(torch.from_numpy(np.array(self.llm.scores[: len(row)], dtype=np.float32)))
        return SimpleNamespace(logits=torch.stack(rows))
