"""llama.cpp's own quantizer, in process through llama-cpp-python: the importance matrix as
`llama-imatrix` collects it and `llama_model_quantize` with and without it, as `llama-quantize` runs.

The importance matrix (tools/imatrix/imatrix.cpp, `IMatrixCollector::collect_imatrix`): llama.cpp
evaluates the full-precision file on the calibration windows with an eval callback; for every
matrix multiplication of a `blk.*` weight by at least 16 rows of f32 activations x it adds Σ x² per
input column and counts the rows. `llama-quantize` then hands llama_model_quantize the mean x² per
column of each weight (tools/quantize/quantize.cpp, `load_imatrix`): in llama-cpp-python 0.3.36 the
`imatrix` parameter is a null-terminated C array of `llama_model_imatrix_data` {name, data, size},
which ctypes builds (older llama.cpp took a C++ map there).
"""

import ctypes
import time
from pathlib import Path

import numpy as np
import torch

from optkit.gate.llama_cpp_buffers import configure_llama_cpp

configure_llama_cpp()  # before any model is loaded: where ggml's AMX kernels fault, without them

GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64
GGML_TYPE_F32 = 0
MIN_ROWS = 16  # collect_imatrix skips smaller batches


class GgmlTensor(ctypes.Structure):
    """ggml.h's `struct ggml_tensor` (the vendored llama.cpp's layout)."""


GgmlTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
    ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(GgmlTensor) * GGML_MAX_SRC),
    ("view_src", ctypes.POINTER(GgmlTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * GGML_MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


def _op_value(name: str) -> int:
    """ggml's enum value of the op `name` (e.g. MUL_MAT), asked of libggml-base's ggml_op_name."""
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_op_name.restype, lib.ggml_op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    for value in range(128):
        if lib.ggml_op_name(value) == name.encode():
            return value
    raise RuntimeError(f"libggml-base names no op {name}")


def _activations(src: GgmlTensor) -> np.ndarray:
    """A tensor's f32 data on the host as [rows, ne[0]], through its byte strides."""
    ne, nb = list(src.ne), list(src.nb)
    floats = (sum((n - 1) * b for n, b in zip(ne, nb, strict=True)) + 4) // 4
    flat = np.ctypeslib.as_array(ctypes.cast(src.data, ctypes.POINTER(ctypes.c_float)), shape=(floats,))
    shaped = np.lib.stride_tricks.as_strided(flat, shape=ne[::-1], strides=nb[::-1])
    return shaped.reshape(-1, ne[0])


class ImatrixCollector:
    """Σ x² per input column and the row count of every `blk.*` weight's matrix multiplications."""

    def __init__(self):
        self.mul_mat = _op_value("MUL_MAT")
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}

    def __call__(self, tensor: int, ask: bool, user_data) -> bool:
        t = GgmlTensor.from_address(tensor)
        if t.op != self.mul_mat:
            return not ask  # asked: not interested; told: carry on
        weight, src1 = t.src[0].contents, t.src[1].contents
        name = weight.name.decode().split("#")[-1] if b"#" in weight.name else weight.name.decode()
        if ask:
            return src1.ne[1] >= MIN_ROWS and src1.type == GGML_TYPE_F32 and name.startswith("blk.")
        x = _activations(src1).astype(np.float64)
        self.sums[name] = self.sums.get(name, 0.0) + (x * x).sum(0)
        self.counts[name] = self.counts.get(name, 0) + x.shape[0]
        return True

    def means(self) -> dict[str, np.ndarray]:
        """What llama-quantize passes on: each weight's mean x² per column (float32)."""
        return {name: (self.sums[name] / self.counts[name]).astype(np.float32) for name in self.sums}


def importance_matrix(model: Path, windows: torch.Tensor, threads: int) -> dict[str, np.ndarray]:
    """llama-imatrix's statistic of `model` (a GGUF) over `windows` [n, seq_len], one chunk each."""
    import llama_cpp
    from llama_cpp_decode import _quiet

    collector = ImatrixCollector()
    callback = llama_cpp.ggml_backend_sched_eval_callback(collector)
    llama_cpp.llama_log_set(_quiet(), ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    loaded = llama_cpp.llama_model_load_from_file(str(model).encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = windows.shape[1]
    params.n_threads = params.n_threads_batch = threads
    params.cb_eval = callback
    ctx = llama_cpp.llama_init_from_model(loaded, params)
    batch = llama_cpp.llama_batch_init(windows.shape[1], 0, 1)
    try:
        for window in windows.tolist():
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            batch.n_tokens = len(window)
            for i, token in enumerate(window):  # every position an output, as llama-imatrix asks
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
                batch.seq_id[i][0] = 0
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError(f"llama_decode failed on {model}")
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(loaded)
    return collector.means()


def quantize(source: Path, out: Path, mix: str, threads: int, importance: dict[str, np.ndarray] | None = None):
    """llama_model_quantize's `mix` (a llama-quantize name: Q4_K_M, ...) of `source`, as llama-quantize
    runs it with its defaults, weighted by `importance` when given."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}")
    params.nthread = threads
    if importance:
        entries = (llama_cpp.llama_model_imatrix_data * (len(importance) + 1))()  # null-terminated
        for entry, (name, values) in zip(entries, importance.items(), strict=False):
            entry.name = name.encode()
            entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entry.size = values.size
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    return out


def decode_tokens_per_s(model: Path, prompt: list[int], new_tokens: int, threads: int) -> float:
    """Greedy decoding speed of `model` in llama.cpp, batch 1 (bench/llama_cpp_decode.py)."""
    from llama_cpp_decode import LlamaCppDecoder

    decoder = LlamaCppDecoder(str(model), 1, len(prompt) + new_tokens, threads)
    try:
        decoder.generate([prompt], 4)  # warm-up
        start = time.perf_counter()
        decoder.generate([prompt], new_tokens)
        return new_tokens / (time.perf_counter() - start)
    finally:
        decoder.close()
