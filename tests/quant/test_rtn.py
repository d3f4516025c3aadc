import pytest
import torch

from optkit.quant.methods.rtn.math import minmax_qparams, quantize, rtn_quantize, signed_max_qparams, weight_error
from optkit.weights.quantized import dequantize
from optkit.weights.schemes import WeightScheme


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_integers_stay_in_range_and_error_is_at_most_half_a_step(bits, symmetric):
    scheme = WeightScheme(bits=bits, group_size=16, symmetric=symmetric)
    w = torch.randn(8, 64)
    qw = rtn_quantize(w, scheme, scale_dtype=torch.float32)
    assert qw.q.dtype == torch.int8
    assert qw.q.min() >= scheme.qmin and qw.q.max() <= scheme.qmax
    assert qw.scale.shape == (8, 4) and qw.zero_point.shape == (8, 4)
    step = qw.scale.repeat_interleave(16, dim=1)
    err = (w - qw.dequantize()).abs()
    if symmetric:
        # the positive end can be clipped by at most one step: qmax = 2^(b-1) - 1 = levels/2 - 1/2
        assert (err <= step * 0.5 + 1e-6).float().mean() > 0.97
        assert (err <= step + 1e-6).all()
        assert (qw.zero_point == 0).all()
    else:
        assert (err <= step * 0.5 + 1e-6).all()


def test_more_bits_means_less_error():
    w = torch.randn(32, 128)
    errors = [
        weight_error(w, rtn_quantize(w, WeightScheme(bits=b, group_size=32)).dequantize())["rel_error"]
        for b in (2, 3, 4, 8)
    ]
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < 0.01


def test_smaller_groups_mean_less_error():
    w = torch.randn(32, 256) * torch.logspace(-1, 1, 256)  # column scales vary, as in real layers
    errors = [
        weight_error(w, rtn_quantize(w, WeightScheme(bits=4, group_size=g)).dequantize())["mse"] for g in (-1, 128, 32)
    ]
    assert errors == sorted(errors, reverse=True)


def test_per_channel_has_one_group_per_row():
    qw = rtn_quantize(torch.randn(6, 40), WeightScheme(bits=4, group_size=-1))
    assert qw.scale.shape == (6, 1)


def test_all_zero_group_quantizes_to_exact_zero():
    w = torch.zeros(4, 32)
    w[:, 16:] = torch.randn(4, 16)
    for symmetric in (True, False):
        qw = rtn_quantize(w, WeightScheme(bits=4, group_size=16, symmetric=symmetric))
        assert torch.isfinite(qw.scale.float()).all()
        assert (qw.dequantize()[:, :16] == 0).all()


def test_asymmetric_represents_zero_exactly():
    w = torch.rand(4, 32) + 0.5  # all positive: the range is widened to include 0
    scheme = WeightScheme(bits=3, group_size=32, symmetric=False)
    scale, zero_point = minmax_qparams(w, scheme, torch.float32)
    q = quantize(torch.zeros(4, 32), scale, zero_point, scheme)
    assert (dequantize(q, scale, zero_point) == 0).all()


def test_scale_is_rounded_to_its_stored_dtype_before_rounding_weights():
    w = torch.randn(16, 64)
    qw = rtn_quantize(w, WeightScheme(bits=8, group_size=32), scale_dtype=torch.bfloat16)
    assert qw.scale.dtype == torch.bfloat16
    # re-quantizing with the stored scale reproduces the stored integers exactly
    assert torch.equal(quantize(w, qw.scale, qw.zero_point, qw.scheme), qw.q)


def test_signed_max_scale_puts_each_groups_largest_magnitude_on_qmin_as_llama_cpp_q4_0():
    w = torch.tensor([[0.5, -1.0, 0.25, 0.1, 2.0, -0.5, 0.3, 0.0]])  # groups of 4: m = -1.0, then 2.0
    scheme = WeightScheme(bits=4, group_size=4)
    scale, zero = signed_max_qparams(w, scheme, torch.float32)
    assert scale.tolist() == [[1.0 / 8, -2.0 / 8]] and not zero.any()
    q = quantize(w, scale, zero, scheme)
    assert q[0, 1] == -8 and q[0, 4] == -8  # exactly representable, the other side reaches 7·|d|
    w_hat = dequantize(q, scale, zero, qmin=scheme.qmin)
    assert w_hat[0, 1] == -1.0 and w_hat[0, 4] == 2.0
    assert (w_hat - w).abs().max() <= scale.abs().max() / 2 + 1e-6
