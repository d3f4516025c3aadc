import pytest
import torch
import torch.nn.functional as F

from optkit.kernels import cpu_int4
from optkit.kernels.packed_int import PackedIntLinear
from optkit.weights.packing import pack_int32, unpack_int32
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme


def random_quantized(bits, group_size, symmetric, act_order=False, out_features=24, in_features=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scheme = WeightScheme(bits=bits, group_size=group_size, symmetric=symmetric)
    size = scheme.group_size_for(in_features)
    groups = in_features // size
    q = torch.randint(scheme.qmin, scheme.qmax + 1, (out_features, in_features), generator=gen).to(torch.int8)
    scale = (torch.rand(out_features, groups, generator=gen) * 0.1 + 1e-3).to(torch.bfloat16)
    if symmetric:
        zero = torch.zeros(out_features, groups, dtype=torch.int8)
    else:
        zero = torch.randint(scheme.qmin, scheme.qmax + 1, (out_features, groups), generator=gen).to(torch.int8)
    g_idx = None
    if act_order:  # each group's columns scattered over the row, as GPTQ act-order leaves them
        g_idx = (torch.randperm(in_features, generator=gen) // size).to(torch.int32)
    return QuantizedWeight(q, scale, zero, scheme, g_idx)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, -1])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_dequantized_weight_is_bit_identical(bits, group_size, symmetric, act_order):
    qw = random_quantized(bits, group_size, symmetric, act_order)
    layer = PackedIntLinear.from_quantized(qw)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(layer.dequantized_weight(dtype), qw.dequantize(dtype))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_forward_is_the_linear_of_the_dequantized_weight(bits):
    qw = random_quantized(bits, 32, False, act_order=bits == 4)
    bias = torch.randn(24)
    layer = PackedIntLinear.from_quantized(qw, bias)
    with cpu_int4.reference_only():  # the CPU kernels are bounded against this in test_cpu_*.py
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(5, 3, 96).to(dtype)
            assert torch.equal(layer(x), F.linear(x, qw.dequantize(dtype), bias.to(dtype)))


def test_weights_stay_packed():
    layer = PackedIntLinear.from_quantized(random_quantized(4, 32, True))
    assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (24, 96 // 8)
    layer = PackedIntLinear.from_quantized(random_quantized(2, 32, True))
    assert layer.qweight.shape == (24, 96 // 16)
    layer = PackedIntLinear.from_quantized(random_quantized(8, 32, True))
    assert layer.qweight.dtype == torch.int8 and layer.qweight.shape == (24, 96)


@pytest.mark.parametrize("width", [2, 4])
def test_pack_round_trip_with_a_partial_last_word(width):
    values = torch.randint(0, 1 << width, (7, 37))
    packed = pack_int32(values, width)
    assert packed.dtype == torch.int32 and packed.shape == (7, -(-37 // (32 // width)))
    assert torch.equal(unpack_int32(packed, width, 37), values.to(torch.int32))
