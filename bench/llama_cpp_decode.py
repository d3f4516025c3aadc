"""Greedy decoding in llama.cpp (llama-cpp-python's low-level API) for bench/cpu_decode.py: the same
prompts and new-token counts as the engine's runs, all sequences in one llama_batch per step (one
llama_decode for the prompts, then one per new token), each sequence its own seq_id in one context.
Greedy = the argmax of each sequence's last logits, read back as numpy. `step_times` keeps the
last call's decode steps after the prompt's (each llama_decode of one new token a sequence and its
argmax), as the engine's time per output token counts them.

llama.cpp takes the thread count it is given (n_threads, n_threads_batch): the bench passes the
torch thread count, so both sides run on as many cores.
"""

import ctypes
import time

import numpy as np

from optkit.gate.llama_cpp_buffers import configure_llama_cpp

configure_llama_cpp()  # before any model is loaded: where ggml's AMX kernels fault, without them

_QUIET = None  # the ctypes callback must outlive every call into llama.cpp


def _quiet() -> object:
    global _QUIET
    if _QUIET is None:
        import llama_cpp

        _QUIET = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    return _QUIET


class LlamaCppDecoder:
    def __init__(self, gguf_path: str, max_seqs: int, max_len: int, threads: int):
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_log_set(_quiet(), ctypes.c_void_p())  # no per-load logging on stderr
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(gguf_path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {gguf_path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max_seqs * max_len
        params.n_batch = params.n_ctx
        params.n_ubatch = params.n_ctx
        params.n_seq_max = max_seqs
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp cannot create a context")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(params.n_ctx, 0, 1)
        self.step_times: list[float] = []

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, row: int) -> int:
        logits = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (self.vocab,)).argmax())

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy continuations of `prompts`, `new_tokens` each, from an empty cache."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        rows, last = [], []
        for seq, prompt in enumerate(prompts):
            rows += [(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)]
            last.append(len(rows) - 1)
        self._decode(rows)
        outputs = [[self._argmax(i)] for i in last]
        self.step_times = []
        for step in range(1, new_tokens):
            start = time.perf_counter()
            self._decode(
                [
                    (out[-1], len(p) + step - 1, seq, True)
                    for seq, (p, out) in enumerate(zip(prompts, outputs, strict=True))
                ]
            )
            for seq, out in enumerate(outputs):
                out.append(self._argmax(seq))
            self.step_times.append(time.perf_counter() - start)
        return outputs
