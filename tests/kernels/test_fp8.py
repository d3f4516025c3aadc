"""FP8 E4M3 W8A8: the emulation the CPU runtime and the gate run equals the textbook formula, and on
a GPU with FP8 tensor cores `torch._scaled_mm` computes the same thing."""

import pytest
import torch

from optkit.kernels.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    FP8Linear,
    fp8_linear,
    fp8_linear_reference,
    quantize_activations,
    scaled_mm_supported,
)
from optkit.quant.methods.fp8.math import fp8_quantize


def _layer(out: int, inp: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g)
    qw = fp8_quantize(w)
    return w, qw, torch.randn(out, generator=g)


def test_activations_are_e4m3_values_with_the_row_absmax_at_448():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 30.0, 500.0, 1.0]).reshape(5, 1)
    q, scale = quantize_activations(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (5, 1)
    torch.testing.assert_close(q.float().abs().amax(dim=1), torch.full((5,), FP8_MAX))
    # every value is its own nearest E4M3 number after scaling: casting again changes nothing
    assert torch.equal(q.float().to(FP8_DTYPE).float(), q.float())
    rel = (q.float() * scale - x).abs() / x.abs().clamp(min=1e-6 * x.abs().max())
    assert rel[x.abs() > x.abs().amax(dim=1, keepdim=True) / 64].max() <= 2**-4 + 1e-6  # 3 mantissa bits


def test_static_scale_is_one_scale_for_every_token_and_clamps_at_448():
    x = torch.tensor([[1.0, -2.0], [100.0, 3.0]])
    q, scale = quantize_activations(x, torch.tensor([0.01]))
    assert torch.equal(scale, torch.full((2, 1), 0.01))
    assert q.float()[1, 0] == FP8_MAX  # 100 / 0.01 = 10000 saturates instead of overflowing to nan


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_emulation_equals_the_reference(static, bias):
    w, qw, b = _layer(48, 96)
    x = torch.randn(3, 7, 96, dtype=torch.float32) * 3
    input_scale = (x.abs().max() / FP8_MAX).reshape(1) if static else None
    args = (x, qw.q, qw.scale.reshape(-1).float(), b if bias else None, input_scale)
    emulated, reference = fp8_linear(*args), fp8_linear_reference(*args)
    assert emulated.shape == (3, 7, 48)
    torch.testing.assert_close(emulated, reference, rtol=1e-5, atol=1e-5)
    # and it is a quantized product: close to, but not equal to, the float one
    exact = x @ w.t() + (b if bias else 0)
    assert 0 < (emulated - exact).abs().max() < 0.1 * exact.abs().max()


def test_fp8_linear_module_keeps_fp8_weights_and_returns_the_input_dtype():
    _, qw, b = _layer(32, 64)
    layer = FP8Linear(qw.q, qw.scale, b)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight.element_size() == 1
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, fp8_linear_reference(x, qw.q, qw.scale.reshape(-1).float(), b), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not scaled_mm_supported(torch.device("cuda")),
    reason="needs a CUDA GPU with compute capability >= 8.9 (FP8 tensor cores)",
)
@pytest.mark.parametrize("static", [False, True])
def test_scaled_mm_matches_the_emulation_on_gpu(static):
    _, qw, b = _layer(256, 512)
    x = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16)
    weight, scale, bias = qw.q.cuda(), qw.scale.reshape(-1).float().cuda(), b.cuda()
    input_scale = (x.float().abs().max() / FP8_MAX).reshape(1) if static else None
    fast = fp8_linear(x, weight, scale, bias, input_scale)
    emulated = fp8_linear(x, weight, scale, bias, input_scale, emulate=True)
    # same fp8 operands and scales; the product is accumulated in fp32 and rounded to bf16 once
    atol = 2e-2 * emulated.float().abs().max().item()
    torch.testing.assert_close(fast.float(), emulated.float(), rtol=2e-2, atol=atol)
