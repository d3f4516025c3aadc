"""NF4Linear: the reference dequantize equals the QuantizedWeight it came from, and the W4A16 Triton
kernel's code-book mode equals the reference (Triton interpreter on CPU, and on CUDA)."""

import pytest
import torch
import torch.nn.functional as F

# first: it sets TRITON_INTERPRET before triton is imported, and skips this module without triton
from tests.kernels.triton_devices import DEVICES

# isort: split

from optkit.kernels.nf4 import NF4Linear
from optkit.kernels.triton import w4a16 as kernels
from optkit.quant.methods.nf4.math import nf4_quantize
from optkit.weights.schemes import WeightScheme


def make_layer(out_features=48, in_features=256, block=64, bias=False, device="cpu", seed=0) -> NF4Linear:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * torch.rand(out_features, 1, generator=gen)
    qw = nf4_quantize(w, WeightScheme(bits=4, group_size=block, type="nf4"))
    b = torch.randn(out_features, generator=gen) if bias else None
    return NF4Linear.from_quantized(qw, b).to(device), qw


def test_reference_path_is_the_quantized_weight_exactly():
    layer, qw = make_layer(bias=True)
    assert torch.equal(layer.codes().to(torch.uint8), qw.q)
    assert torch.equal(layer.dequantized_weight(), qw.dequantize())
    x = torch.randn(5, 256)
    torch.testing.assert_close(layer(x), F.linear(x, qw.dequantize(), layer.bias), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("block", [64, 128])
def test_triton_code_book_mode_matches_the_reference(device, rows, block):
    layer, _ = make_layer(block=block, bias=True, device=device)
    packed = kernels.packed_for(layer)
    assert packed is not None and packed.codebook is not None
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows)).to(device)
    out = kernels.w4a16_linear(x, packed, layer.bias)
    torch.testing.assert_close(out, F.linear(x, layer.dequantized_weight(), layer.bias), atol=1e-4, rtol=1e-4)
