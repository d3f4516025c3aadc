"""GGUF block packing: optkit's bytes are what llama.cpp's own reference (gguf-py) reads back."""

import numpy as np
import pytest
import torch

from optkit.quant.methods.gptq.math import gptq_quantize
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.weights import gguf_blocks
from optkit.weights.stored import StoredScheme
from tests.weights.block_rows import block_test_rows

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

SCHEMES = {
    "Q4_0": StoredScheme(bits=4, group_size=32, symmetric=True),
    "Q4_1": StoredScheme(bits=4, group_size=32, symmetric=False, float_zero=True),
    "Q8_0": StoredScheme(bits=8, group_size=32, symmetric=True),
    "Q5_0": StoredScheme(bits=5, group_size=32, symmetric=True),
    "Q5_1": StoredScheme(bits=5, group_size=32, symmetric=False, float_zero=True),
}


def _reference_dequantize(qtype: str, data: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    out = gguf_quants.dequantize(data.numpy(), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(shape)


def _rows(kind: str) -> torch.Tensor:
    """[6, 128] weights: random rows over three decades, or rows with an outlier, constant or zero blocks."""
    return block_test_rows(kind, 6, 128, (-3, 0))


@pytest.mark.parametrize("rows", ["random", "outlier", "constant", "zero"])
@pytest.mark.parametrize("qtype", SCHEMES)
def test_packed_blocks_dequantize_in_gguf_py_to_exactly_optkits_weights(qtype, rows):
    w = _rows(rows)
    qw = rtn_quantize(w, SCHEMES[qtype])
    assert qw.scale.dtype == torch.float16
    m = qw.zero_point if qtype in gguf_blocks.WITH_MINIMUM else None
    data = gguf_blocks.pack(qtype, qw.q, qw.scale, m)
    assert data.shape == (6, 4 * gguf_blocks.BLOCK_BYTES[qtype])
    assert torch.equal(_reference_dequantize(qtype, data, w.shape), qw.dequantize())
    assert torch.equal(gguf_blocks.dequantize(qtype, data, 128), qw.dequantize())
    q, d, m_back = gguf_blocks.unpack(qtype, data, 128)
    assert torch.equal(q, qw.q) and torch.equal(d, qw.scale)
    assert (m_back is None) == (m is None) and (m is None or torch.equal(m_back, m))


@pytest.mark.parametrize("qtype", SCHEMES)
def test_gguf_py_quantized_blocks_unpack_to_the_values_gguf_py_reads(qtype):
    """Bytes llama.cpp's Python quantizer wrote, read by optkit: the same weights."""
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    data = torch.from_numpy(gguf_quants.quantize(w, GGMLQuantizationType[qtype]))
    assert torch.equal(gguf_blocks.dequantize(qtype, data, 64), _reference_dequantize(qtype, data, (4, 64)))


def test_float_zero_point_is_a_rounded_minimum_off_the_scale_grid():
    """Q4_1's m is the group's minimum in fp16, not a multiple of d: an integer zero point could not hold it."""
    w = torch.linspace(0.3, 1.1, 32).reshape(1, 32)  # no zero in the range
    qw = rtn_quantize(w, SCHEMES["Q4_1"])
    assert qw.zero_point.dtype == torch.float16
    assert qw.zero_point.item() == torch.tensor(0.3).half().item()
    assert (qw.dequantize() - w).abs().max() <= qw.scale.float().item() / 2 + 1e-3


def test_gptq_on_a_stored_scheme_writes_exactly_what_it_optimised():
    """GPTQ's loop rounds onto the fp16 scales and minima the blocks keep: packing loses nothing."""
    torch.manual_seed(2)
    w, x = torch.randn(8, 64), torch.randn(256, 64)
    hessian = 2 * x.T @ x / x.shape[0]
    for qtype, scheme in SCHEMES.items():
        result = gptq_quantize(w, hessian, scheme)
        qw = result.weight
        assert qw.scale.dtype == torch.float16
        m = qw.zero_point if qtype in gguf_blocks.WITH_MINIMUM else None
        data = gguf_blocks.pack(qtype, qw.q, qw.scale, m)
        assert torch.equal(gguf_blocks.dequantize(qtype, data, 64), qw.dequantize()), qtype
        assert torch.equal(_reference_dequantize(qtype, data, w.shape), qw.dequantize()), qtype
        rtn = rtn_quantize(w, scheme).dequantize()
        assert result.loss <= ((w - rtn) @ hessian * (w - rtn)).sum().item() / 2, qtype


def test_pack_refuses_integers_outside_the_block_type():
    q = torch.full((1, 32), 9, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        gguf_blocks.pack("Q4_0", q, torch.ones(1, 1, dtype=torch.float16))
    gguf_blocks.pack("Q5_0", q, torch.ones(1, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[-16, 15\]"):
        gguf_blocks.pack("Q5_0", q * 2, torch.ones(1, 1, dtype=torch.float16))


def test_q5_blocks_keep_each_fifth_bit_in_its_elements_bit_of_qh():
    """Element j's bit 4 is bit j of the little-endian uint32 qh (ggml-common.h block_q5_0), its low
    4 bits in qs as Q4_0's nibbles: level 16 (q = 0) at element 3 only sets bit 3, and so on."""
    q = torch.full((1, 32), -16, dtype=torch.int8)
    q[0, 3], q[0, 20], q[0, 31] = 0, 15, -1  # levels 16, 31, 15
    data = gguf_blocks.pack("Q5_0", q, torch.ones(1, 1, dtype=torch.float16))
    qh = int.from_bytes(bytes(data[0, 2:6].tolist()), "little")
    assert qh == (1 << 3) | (1 << 20)
    assert data[0, 6 + 3].item() == 0 and data[0, 6 + 4].item() == 0xF0 and data[0, 6 + 15].item() == 0xF0


def test_awq_searches_onto_the_q4_1_grid_the_blocks_hold():
    """AWQ's clipping search and its fake quantization round onto fp16 scales and minima: what it
    measures is what Q4_1 blocks store."""
    from optkit.quant.methods.awq import math as awq

    torch.manual_seed(3)
    w, x = torch.randn(4, 64), torch.randn(128, 64)
    scheme = SCHEMES["Q4_1"]
    clipped = awq.clip(w, awq.search_clip(w, x, scheme, steps=4))
    qw = rtn_quantize(clipped, scheme)
    data = gguf_blocks.pack("Q4_1", qw.q, qw.scale, qw.zero_point)
    assert torch.equal(gguf_blocks.dequantize("Q4_1", data, 64), awq.fake_quantize(clipped, scheme))
