"""The runtime's RoPE (roll and a signed sin) and its RMSNorm outside fp32 (one F.rms_norm call) give
the same bits as transformers' formulas: rotate_half, and the explicit mean of squares. On the CPU the
C++ operators of kernels/cpu_decode.py take both: RoPE keeps the same bits, RMSNorm sums its squares
in another order, so a bfloat16 output may sit one rounding step away (rarely: it is rounded from
float32 values an ulp apart)."""

import pytest
import torch

from optkit.kernels import cpu_decode
from optkit.models.llama import RMSNorm, apply_rope, rope_cos_sin


@pytest.fixture(params=["pytorch", "c++"])
def path(request, monkeypatch):
    """The PyTorch code, or the C++ operators where they build."""
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_decode, "enabled", lambda x: False)
    elif cpu_decode.unavailable_reason():
        pytest.skip(cpu_decode.unavailable_reason())
    return request.param


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """transformers' Llama: cos/sin of cat(freqs, freqs), x·cos + rotate_half(x)·sin over the first R dims."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (angles.cos() * scaling).to(x.dtype)[:, None], (angles.sin() * scaling).to(x.dtype)[:, None]
    rotary = cos.shape[-1]
    rotated = x[..., :rotary] * cos + hf_rotate_half(x[..., :rotary]) * sin
    return torch.cat((rotated, x[..., rotary:]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary", [64, 32])  # 32 of 64: partial rotary (Phi, GPT-NeoX style configs)
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_rope_is_bit_identical_to_rotate_half(path, dtype, rotary, tokens):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 6, 64).to(dtype)
    positions = torch.randint(0, 4096, (tokens,))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
    cos, sin = rope_cos_sin(positions, inv_freq, 1.0, dtype)
    assert cos.shape == sin.shape == (tokens, 1, rotary)
    got = apply_rope(x, cos, sin)
    assert torch.equal(got, hf_apply_rope(x, positions, inv_freq, 1.0))
    assert not torch.equal(got, x)  # the rotation is not a no-op: the check can fail


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weight_in_float32", [False, True])
def test_rms_norm_outside_fp32_is_bit_identical_to_the_explicit_formula(path, dtype, weight_in_float32):
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5, weight_in_float32)
    norm.weight.data = torch.randn(576).to(dtype)
    x = (torch.randn(370, 576) * 3).to(dtype)
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    want = (norm.weight * normed).to(dtype) if weight_in_float32 else norm.weight * normed.to(dtype)
    got = norm(x)
    if path == "pytorch" or dtype == torch.float16:  # the C++ operators take float32 and bfloat16
        assert torch.equal(got, want)
        return
    step = torch.finfo(dtype).eps * want.float().abs()  # one rounding step (an ulp or two) of each value
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got != want).float().mean() < 1e-3
