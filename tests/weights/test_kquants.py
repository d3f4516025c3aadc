"""ggml's K-quants: optkit's super-block bytes are what llama.cpp's reference (gguf-py) reads back,
bit for bit, for fitted grids and adversarial rows; a weight K-quants cannot hold is one line."""

import numpy as np
import pytest
import torch

from optkit.errors import OptkitError
from optkit.weights import kquants
from optkit.weights.kquants import layout

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402


def _gguf_py(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    out = gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(shape)


def _rows() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    gauss = torch.randn(6, 512) * torch.logspace(-2, 1, 6).unsqueeze(1)
    spiky = torch.randn(2, 512)
    spiky[:, ::97] *= 40  # an outlier per few sub-blocks
    one_sided = torch.rand(2, 512) + 0.5  # no zero in the range: the minimum is far from 0
    return {
        "gaussian": gauss,
        "outliers": spiky,
        "positive": one_sided,
        "negative": -one_sided,
        "zeros": torch.zeros(2, 512),
        "constant": torch.full((2, 512), 0.37),
        "half_zero": torch.cat([torch.zeros(2, 256), torch.randn(2, 256)], dim=1),
        "huge": torch.randn(2, 256) * 3e3,
        "tiny": torch.randn(2, 256) * 1e-6,
    }


@pytest.mark.parametrize("qtype", kquants.K_TYPES)
def test_quantized_rows_dequantize_in_gguf_py_to_exactly_the_weights_optkit_chose(qtype):
    for name, w in _rows().items():
        raw, dequantized = kquants.quantize_rows(w, qtype)
        assert raw.dtype == torch.uint8
        assert raw.shape == (w.shape[0], w.shape[1] // kquants.QK_K * kquants.block_bytes(qtype)), name
        assert torch.equal(_gguf_py(raw, qtype, w.shape), dequantized), (qtype, name)
        assert torch.equal(kquants.dequantize_rows(raw, qtype, w.shape[1]), dequantized), (qtype, name)
        assert torch.isfinite(dequantized).all(), (qtype, name)


@pytest.mark.parametrize("qtype", kquants.K_TYPES)
def test_unpack_then_pack_gives_back_the_same_bytes_for_any_levels_and_scales(qtype):
    """Every bit of every field: random bytes (their fp16 d and dmin set finite) survive unpack and pack."""
    kind = layout.TYPES[qtype]
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (3, 2 * kind.block_bytes), dtype=torch.uint8, generator=g)
    halves = {"Q2_K": (80, 84), "Q3_K": (108, 110), "Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210)}[qtype]
    blocks = raw.view(3, 2, kind.block_bytes)
    blocks[..., halves[0] : halves[1]] = (
        torch.tensor([0.5], dtype=torch.float16).view(torch.uint8).repeat((halves[1] - halves[0]) // 2)
    )
    q_u, grid = kquants.unpack(qtype, raw, 512)
    assert q_u.max() < 1 << kind.bits
    assert torch.equal(kquants.pack(qtype, q_u, grid), raw)
    assert torch.equal(kquants.dequantize_rows(raw, qtype, 512), _gguf_py(raw, qtype, (3, 512)))


@pytest.mark.parametrize("qtype", kquants.K_TYPES)
def test_importance_lowers_the_weighted_error_it_names(qtype):
    """Columns marked important are reproduced better than without the importance."""
    torch.manual_seed(2)
    w = torch.randn(32, 512)
    importance = torch.ones(512)
    importance[::8] = 100.0
    plain = kquants.quantize_rows(w, qtype)[1]
    weighted = kquants.quantize_rows(w, qtype, importance)[1]

    def error(w_hat):
        return ((w_hat - w).pow(2) * importance).sum().item()

    assert error(weighted) < error(plain)


def test_more_bits_means_less_error_down_the_k_ladder():
    torch.manual_seed(3)
    w = torch.randn(16, 1024)
    errors = [(kquants.quantize_rows(w, t)[1] - w).pow(2).mean().item() for t in kquants.K_TYPES]
    assert errors == sorted(errors, reverse=True)
    assert errors[kquants.K_TYPES.index("Q4_K")] < 0.006  # 4.5 bits per weight on a Gaussian


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_weight_with_nan_or_inf_is_refused_in_one_line(bad):
    w = torch.randn(2, 256)
    w[1, 7] = bad
    with pytest.raises(OptkitError, match="NaN or inf") as caught:
        kquants.quantize_rows(w, "Q4_K")
    assert "\n" not in str(caught.value)


def test_a_row_not_in_whole_super_blocks_is_refused_naming_the_fallback():
    with pytest.raises(OptkitError, match="super-blocks of 256 columns.*Q4_0"):
        kquants.quantize_rows(torch.randn(2, 288), "Q4_K")


def test_a_weight_beyond_fp16_scales_is_refused_in_one_line():
    with pytest.raises(OptkitError, match="too large for a K-quant's fp16"):
        kquants.quantize_rows(torch.randn(2, 256) * 1e9, "Q6_K")
