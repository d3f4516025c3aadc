import torch

from optkit.kernels import cpu_int8_gemv, w8a8
from optkit.kernels.w8a8 import W8A8Linear, int8_linear, int8_linear_reference, quantize_activations
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.weights.schemes import W8_PER_CHANNEL


def make_layer(out_features=48, in_features=64, static=False):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    qw = rtn_quantize(weight, W8_PER_CHANNEL, torch.float32)
    input_scale = torch.tensor([0.05]) if static else None
    return weight, W8A8Linear(qw.q, qw.scale, torch.randn(out_features), input_scale)


def test_the_matmul_is_int8(monkeypatch):
    """Acceptance: the W8A8 module multiplies int8 by int8 into int32 (through torch._int_mm here; optkit's
    GEMV, which takes these rows on AVX2 CPUs, is held to _int_mm's int32 result in test_cpu_int8_gemv.py)."""
    monkeypatch.setattr(cpu_int8_gemv, "takes", lambda qx, weight_t: False)
    calls = []
    real = torch._int_mm

    def spy(a, b):
        calls.append((a.dtype, b.dtype))
        out = real(a, b)
        assert out.dtype == torch.int32
        return out

    monkeypatch.setattr(torch, "_int_mm", spy)
    _, layer = make_layer()
    layer(torch.randn(3, 5, 64))
    assert calls == [(torch.int8, torch.int8)]
    assert w8a8.torch is torch  # the kernel module calls the patched function


def test_int8_matmul_matches_its_float_reference_and_the_float_layer():
    weight, layer = make_layer()
    x = torch.randn(7, 64)
    y = layer(x)
    reference = int8_linear_reference(x, layer.weight_t, layer.weight_scale, layer.bias)
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
    exact = x @ weight.T + layer.bias
    assert ((y - exact).abs().max() / exact.abs().max()) < 0.02  # int8 rounding of both operands


def test_static_activation_scale_is_used():
    _, layer = make_layer(static=True)
    x = torch.randn(4, 64) * 0.5
    qx, sx = quantize_activations(x, layer.input_scale)
    assert torch.all(sx == 0.05)
    torch.testing.assert_close(
        layer(x), int8_linear(x, layer.weight_t, layer.weight_scale, layer.bias, torch.tensor([0.05]))
    )


def test_per_token_scales_follow_each_row():
    x = torch.tensor([[1.0, -2.0], [100.0, 50.0]])
    qx, sx = quantize_activations(x)
    assert torch.allclose(sx.flatten(), torch.tensor([2.0 / 127, 100.0 / 127]))
    assert qx.abs().amax(dim=1).tolist() == [127, 127]
