"""The Triton W4A16 matmul against `PackedIntLinear`'s reference path: on CPU under the Triton
interpreter (TRITON_INTERPRET=1, set by triton_devices when there is no GPU), and on CUDA."""

import pytest
import torch
import torch.nn.functional as F

# first: it sets TRITON_INTERPRET before triton is imported, and skips this module without triton
from tests.kernels.triton_devices import DEVICES

# isort: split

import optkit.kernels.triton as triton_kernels
from optkit.kernels.packed_int import PackedIntLinear
from optkit.kernels.triton import w4a16 as kernels
from optkit.weights.quantized import QuantizedWeight
from optkit.weights.schemes import WeightScheme


def make_layer(bits, group_size, symmetric=False, act_order=False, out_features=48, in_features=256, bias=False,
               device="cpu", seed=0):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    scheme = WeightScheme(bits=bits, group_size=group_size, symmetric=symmetric)
    size = scheme.group_size_for(in_features)
    groups = in_features // size
    q = torch.randint(scheme.qmin, scheme.qmax + 1, (out_features, in_features), generator=gen).to(torch.int8)
    scale = (torch.rand(out_features, groups, generator=gen) * 0.1 + 1e-3).to(torch.bfloat16)
    zero = torch.zeros(out_features, groups, dtype=torch.int8)
    if not symmetric:
        zero = torch.randint(scheme.qmin, scheme.qmax + 1, (out_features, groups), generator=gen).to(torch.int8)
    g_idx = (torch.randperm(in_features, generator=gen) // size).to(torch.int32) if act_order else None
    b = torch.randn(out_features, generator=gen) if bias else None
    return PackedIntLinear.from_quantized(QuantizedWeight(q, scale, zero, scheme, g_idx), b).to(device)


def check(layer, rows, dtype=torch.float32, tol=1e-4, **overrides):
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows)).to(
        layer.scale.device, dtype
    )
    packed = kernels.packed_for(layer)
    assert packed is not None
    bias = None if layer.bias is None else layer.bias.to(dtype)
    out = kernels.w4a16_linear(x, packed, bias, **overrides)
    assert out.dtype == dtype and out.shape == (rows, layer.out_features)
    torch.testing.assert_close(out, F.linear(x, layer.dequantized_weight(dtype), bias), atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3, 16, 33])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_matches_the_reference(group_size, bits, rows, device):
    check(make_layer(bits, group_size, device=device), rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_reads_x_through_the_permutation(bits, rows, device):
    layer = make_layer(bits, 32, symmetric=True, act_order=True, device=device)
    packed = kernels.packed_for(layer)
    assert packed.perm is not None and packed.qweight.data_ptr() != layer.qweight.data_ptr()  # repacked once
    check(layer, rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("in_features", [96, 104])  # per-channel groups of 96 and 104 columns: not powers of 2
def test_per_channel_groups_and_ragged_k(in_features, rows, device):
    check(make_layer(4, -1, in_features=in_features, device=device), rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_split_k(split_k, rows, device):
    check(make_layer(4, 32, bias=True, in_features=512, device=device), rows, SPLIT_K=split_k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_half_precision_with_bias(dtype, rows, device):
    check(make_layer(4, 128, bias=True, device=device), rows, dtype, tol=2e-2)


def test_layouts_the_kernel_cannot_take_use_the_reference():
    scattered = make_layer(4, 32, act_order=True)
    scattered.g_idx = torch.randint(0, 8, (256,), dtype=torch.int32)  # groups of unequal sizes
    assert kernels.packed_for(scattered) is None
    assert kernels.packed_for(make_layer(2, -1, in_features=104)) is None  # a group ends inside a word


@pytest.mark.parametrize("device", DEVICES)
def test_the_layer_dispatches_to_triton(monkeypatch, device):
    """On CUDA (on CPU: with `use_triton` patched true), PackedIntLinear.forward runs the kernel; a
    changed buffer is noticed, and a g_idx the kernel cannot take falls back to the reference."""
    layer = make_layer(4, 32, act_order=True, bias=True, device=device)
    x = torch.randn(2, 3, 256, device=device)
    expected = F.linear(x, layer.dequantized_weight(), layer.bias)
    if device == "cpu":
        monkeypatch.setattr(triton_kernels, "use_triton", lambda t: True)
    calls = []
    real = kernels.w4a16_linear
    monkeypatch.setattr(kernels, "w4a16_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    assert calls == [1]
    layer.g_idx = torch.randint(0, 8, (256,), dtype=torch.int32, device=device)  # groups of unequal sizes
    expected = F.linear(x, layer.dequantized_weight(), layer.bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-4)
    assert calls == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_layers_built_in_inference_mode(device):
    """Inference tensors have no version counter; the packed-weight cache must not need one."""
    with torch.inference_mode():
        layer = make_layer(4, 128, device=device)
        check(layer, 1)
