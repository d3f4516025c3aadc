"""IQ4_NL blocks: optkit's bytes are what gguf-py reads back, and optkit's quantizer writes the bytes
ggml's own quantize_iq4_nl writes (the libggml-base llama-cpp-python ships, called through ctypes)."""

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from optkit.weights import gguf_iq4nl
from tests.weights.block_rows import block_test_rows

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402


def _ggml_quantize():
    """ggml's size_t quantize_iq4_nl(const float * src, void * dst, int64_t nrow, int64_t n_per_row,
    const float * quant_weights), or None without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    libraries = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.so*"))
    if not libraries:
        return None
    function = ctypes.CDLL(str(libraries[0])).quantize_iq4_nl
    function.restype = ctypes.c_size_t
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return function


GGML_QUANTIZE = _ggml_quantize()
needs_ggml = pytest.mark.skipif(GGML_QUANTIZE is None, reason="llama.cpp: pip install 'optkit[gguf]'")


def _ggml_bytes(w: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    src = np.ascontiguousarray(w.numpy(), dtype=np.float32)
    dst = np.zeros((w.shape[0], w.shape[1] // 32 * gguf_iq4nl.BLOCK_BYTES), dtype=np.uint8)
    weights = None if importance is None else np.ascontiguousarray(importance.numpy(), dtype=np.float32)
    GGML_QUANTIZE(
        src.ctypes.data, dst.ctypes.data, w.shape[0], w.shape[1], None if weights is None else weights.ctypes.data
    )
    return torch.from_numpy(dst)


def _rows(kind: str, seed: int = 0) -> torch.Tensor:
    """[16, 256] weights over four decades, or with outliers, constant blocks or zero blocks."""
    return block_test_rows(kind, 16, 256, (-3, 1), seed)


def _reference_dequantize(data: torch.Tensor, shape) -> torch.Tensor:
    out = gguf_quants.dequantize(data.numpy(), GGMLQuantizationType.IQ4_NL)
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(shape)


@pytest.mark.parametrize("rows", ["random", "outlier", "constant", "zero"])
def test_packed_blocks_dequantize_in_gguf_py_to_exactly_optkits_weights(rows):
    w = _rows(rows)
    indices, d = gguf_iq4nl.quantize(w)
    data = gguf_iq4nl.pack(indices, d)
    assert data.shape == (16, 8 * gguf_iq4nl.BLOCK_BYTES)
    ours = gguf_iq4nl.dequantize(data, 256)
    assert torch.equal(_reference_dequantize(data, w.shape), ours)
    assert torch.isfinite(ours).all()
    back, d_back = gguf_iq4nl.unpack(data, 256)
    assert torch.equal(back, indices) and torch.equal(d_back, d)
    if rows == "zero":
        assert torch.equal(ours[5], torch.zeros(256)) and torch.equal(ours[:, 32:96], torch.zeros(16, 64))


@needs_ggml
@pytest.mark.parametrize("rows", ["random", "outlier", "constant", "zero"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_quantizer_writes_the_bytes_ggmls_quantize_iq4_nl_writes(rows, weighted):
    """quantize_row_iq4_nl_impl's scale search, without and with an importance matrix, byte for byte."""
    importance = torch.rand(256, generator=torch.Generator().manual_seed(1)) * 3 if weighted else None
    for seed in range(3):
        w = _rows(rows, seed)
        assert torch.equal(gguf_iq4nl.pack(*gguf_iq4nl.quantize(w, importance)), _ggml_bytes(w, importance))


def test_the_scale_search_beats_the_plain_absmax_scale():
    """The ±7 steps around d = max/127 keep the scale of least weighted error: never worse than the start."""
    w = _rows("random")
    searched = gguf_iq4nl.dequantize(gguf_iq4nl.pack(*gguf_iq4nl.quantize(w)), 256)
    blocks = w.reshape(16, 8, 32)
    peak = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = (peak / 127).squeeze(-1).half()
    plain = gguf_iq4nl.nearest(blocks / d.float().unsqueeze(-1))
    start = gguf_iq4nl.dequantize(gguf_iq4nl.pack(plain.reshape(16, 256), d), 256)
    weight = (w * w).reshape(16, 8, 32)
    error = [((weight * (x - w).reshape(16, 8, 32) ** 2).sum(-1)) for x in (searched, start)]
    assert (error[0] <= error[1] * 1.01).float().mean() > 0.95 and error[0].sum() < error[1].sum()


def test_pack_refuses_what_a_block_cannot_hold():
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        gguf_iq4nl.pack(torch.full((1, 32), 16, dtype=torch.uint8), torch.ones(1, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        gguf_iq4nl.quantize(torch.ones(1, 48))
