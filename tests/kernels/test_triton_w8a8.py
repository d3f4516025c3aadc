"""The Triton W8A8 kernels against `optkit.kernels.w8a8`'s reference: on CPU under the Triton
interpreter (TRITON_INTERPRET=1, set by triton_devices when there is no GPU), and on CUDA."""

import pytest
import torch

# first: it sets TRITON_INTERPRET before triton is imported, and skips this module without triton
from tests.kernels.triton_devices import DEVICES

# isort: split

import optkit.kernels.triton as triton_kernels
from optkit.kernels import w8a8 as reference
from optkit.kernels.triton import w8a8 as kernels


def make_weight(n=48, k=160, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight_t = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8)
    weight_scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    bias = torch.randn(n, generator=gen)
    return weight_t.to(device), weight_scale.to(device), bias.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("static", [False, True])
def test_activation_quantization_is_bit_identical(static, device):
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(1)).to(device) * 3
    x[0, :4] = torch.tensor([0.5, -0.5, 1.5, -2.5]) * (x[0].abs().max() / 127)  # ties: halves round to even
    x[1] = 0  # an all-zero row: the 1e-12 floor on the scale
    scale = torch.tensor([0.02], device=device) if static else None
    q, s = kernels.quantize_activations(x, scale)
    expected_q, expected_s = reference.quantize_activations(x, scale)
    assert torch.equal(s, expected_s) and torch.equal(q, expected_q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3, 16, 33, 80])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(dtype, rows, device):
    weight_t, weight_scale, bias = make_weight(device=device)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows)).to(device, dtype)
    out = kernels.int8_linear(x, weight_t, weight_scale, bias, None)
    expected = reference.int8_linear_reference(x, weight_t, weight_scale, bias)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("k_major", [False, True])
def test_split_k_and_weight_layouts(k_major, split_k, device):
    """Int32 partials sum exactly; a [N, K] row-major weight passed as its transpose reads the same."""
    weight_t, weight_scale, bias = make_weight(k=200, device=device)
    if k_major:
        weight_t = weight_t.t().contiguous().t()
    x = torch.randn(2, 5, 200, generator=torch.Generator().manual_seed(0)).to(device)
    out = kernels.int8_linear(x, weight_t, weight_scale, None, torch.tensor([0.03], device=device), SPLIT_K=split_k)
    expected = reference.int8_linear_reference(x, weight_t, weight_scale, None, torch.tensor([0.03], device=device))
    assert out.shape == (2, 5, 48)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_int8_linear_dispatches_to_triton(monkeypatch, device):
    """On CUDA (on CPU: with `use_triton` patched true), W8A8Linear's matmul is the Triton kernel,
    and an explicit int_mm (the float reference) keeps the PyTorch path."""
    weight_t, weight_scale, bias = make_weight(device=device)
    layer = reference.W8A8Linear(weight_t.t(), weight_scale, bias)
    x = torch.randn(4, 160, device=device)
    expected = reference.int8_linear_reference(x, layer.weight_t, layer.weight_scale, layer.bias)
    if device == "cpu":
        monkeypatch.setattr(triton_kernels, "use_triton", lambda t: True)
    calls = []
    real = kernels.int8_linear
    monkeypatch.setattr(kernels, "int8_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert calls == [1]
    reference.int8_linear_reference(x, layer.weight_t, layer.weight_scale, layer.bias)
    assert calls == [1]
