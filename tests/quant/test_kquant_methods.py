"""RTN, GPTQ and AWQ onto ggml's K-quant grids (weights/kquants): what each method chose is what the
GGUF bytes hold, bit for bit as gguf-py dequantizes them, and GPTQ's error feedback on the fitted
super-block grids beats rounding to nearest on them."""

import numpy as np
import pytest
import torch

from optkit.errors import OptkitError
from optkit.quant.formats import gguf as gguf_format
from optkit.quant.methods.awq import math as awq
from optkit.quant.methods.gptq.math import gptq_quantize, output_error
from optkit.quant.methods.gptq.options import GPTQOptions
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.weights import kquants
from optkit.weights.schemes import WeightScheme
from optkit.weights.stored import k_scheme

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402


def _problem(seed: int = 0, out: int = 48, width: int = 512):
    """A weight and the Hessian 2XᵀX/N of inputs whose channels differ in scale (as activations do)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, width, generator=g) * (0.2 + 3 * torch.rand(width, generator=g))
    return torch.randn(out, width, generator=g) * 0.05, 2 * x.T @ x / x.shape[0], x


def _file_weights(prefix: str, qw, qtype: str) -> torch.Tensor:
    """What llama.cpp reads for the linear: the format's bytes, dequantized by gguf-py."""
    raw = gguf_format.compress(prefix, qw)[f"{prefix}.{gguf_format.MARKER}"]
    out = gguf_quants.dequantize(raw.numpy(), GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(qw.q.shape)


@pytest.mark.parametrize("qtype", kquants.K_TYPES)
def test_each_method_writes_exactly_the_weights_it_chose_on_the_k_grid(qtype):
    w, hessian, x = _problem()
    scheme = gguf_format.constrain(WeightScheme(bits=4, group_size=32), qtype)
    assert gguf_format.block_type(scheme) == qtype and scheme == k_scheme(qtype)
    plain = gptq_quantize(w, hessian, scheme).weight
    ordered = gptq_quantize(w, hessian, scheme, GPTQOptions(act_order=True, static_groups=True)).weight
    bounds = awq.search_clip(w, x[:256], scheme, steps=4)
    clipped = awq.clip(w, bounds)
    chosen = {"rtn": rtn_quantize(w, scheme), "gptq": plain, "gptq act-order": ordered}
    chosen["awq"] = rtn_quantize(clipped, scheme)
    for method, qw in chosen.items():
        assert qw.g_idx is None, method
        assert torch.equal(_file_weights("layer", qw, qtype), qw.dequantize()), method
    assert torch.equal(awq.fake_quantize(clipped, scheme), chosen["awq"].dequantize())


@pytest.mark.parametrize("qtype", kquants.K_TYPES)
def test_gptq_on_a_k_grid_has_a_lower_output_error_than_rtn_on_it(qtype):
    w, hessian, _ = _problem(seed=1)
    scheme = k_scheme(qtype)
    rtn = output_error(w, rtn_quantize(w, scheme).dequantize(), hessian)
    for options in (GPTQOptions(), GPTQOptions(act_order=True, static_groups=True)):
        gptq = gptq_quantize(w, hessian, scheme, options)
        assert gptq.loss < 0.9 * rtn, (qtype, options)


def test_the_decompressed_k_weight_is_the_one_compressed():
    """The staged artifact's bytes read back (decompress) as the very QuantizedWeight the method made."""
    w, hessian, _ = _problem(seed=2, width=256)
    for qtype in kquants.K_TYPES:
        scheme = k_scheme(qtype)
        qw = gptq_quantize(w, hessian, scheme).weight
        back = gguf_format.decompress("p", gguf_format.compress("p", qw), scheme)
        assert torch.equal(back.q, qw.q) and torch.equal(back.dequantize(), qw.dequantize()), qtype


def test_a_sub_block_whose_scale_is_zero_rounds_to_its_offset():
    """A zero sub-block beside a large one: its sub-scale is 0, GPTQ and RTN still write finite bytes."""
    w, hessian, _ = _problem(seed=3, out=4, width=256)
    w[:, :32] = 0
    w[:, 32:64] *= 1e3
    for qtype in kquants.K_TYPES:
        for qw in (rtn_quantize(w, k_scheme(qtype)), gptq_quantize(w, hessian, k_scheme(qtype)).weight):
            assert torch.isfinite(qw.dequantize()).all(), qtype
            assert torch.equal(_file_weights("p", qw, qtype), qw.dequantize()), qtype


def test_the_format_refuses_a_k_type_for_a_width_neither_it_nor_its_fallback_divides():
    """Rows 256 does not divide fall back to a legacy type of 32 columns (Q4_K: Q5_0); 32 must divide them."""
    gguf_format.check(k_scheme("Q4_K"), False, [("model.layers.0.mlp.up_proj", 256, 288)])
    gguf_format.check(k_scheme("Q4_K"), False, [("model.layers.0.mlp.down_proj", 288, 128)])
    with pytest.raises(OptkitError, match=r"down_proj \(128×300\): Q4_K blocks \(or its fallback Q5_0's\) need"):
        gguf_format.check(k_scheme("Q4_K"), False, [("model.layers.0.mlp.down_proj", 300, 128)])
