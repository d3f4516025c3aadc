"""`--method nf4`: NF4 weights with blockwise absmax (and optional double quantization), written in
bitsandbytes' serialization, read back by bitsandbytes and transformers, run by the runtime."""

import json

import pytest
import torch
from safetensors import safe_open

from optkit.compat.transformers_load import check_transformers_load
from optkit.errors import OptkitError
from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions
from optkit.kernels.nf4 import NF4Linear
from optkit.models.loader import load_runtime_model
from optkit.quant.formats import bitsandbytes as bnb_format
from optkit.quant.methods.nf4.math import NF4_BLOCK64, nf4_quantize
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.codebooks import NF4_VALUES
from optkit.weights.schemes import WeightScheme

DOUBLE = WeightScheme(bits=4, group_size=64, type="nf4", double_quant=True)
DOWN = "model.layers.0.mlp.down_proj"


def _weight(out=96, inp=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g) * torch.rand(out, 1, generator=g) * 0.1


def test_codes_are_the_nearest_nf4_value_of_each_block_scaled_weight():
    w = _weight()
    qw = nf4_quantize(w)
    blocks = w.reshape(96, 4, 64)
    torch.testing.assert_close(qw.scale, blocks.abs().amax(dim=-1), rtol=0, atol=0)
    scaled = (blocks / qw.scale.unsqueeze(-1)).reshape(96, 256)
    distance = (torch.tensor(NF4_VALUES)[None, None, :] - scaled[..., None]).abs()
    chosen = distance.gather(-1, qw.q.long()[..., None])[..., 0]
    assert torch.all(chosen <= distance.min(dim=-1).values + 1e-7)  # no value of the code book is nearer
    assert qw.q.max() <= 15 and (qw.q == 15).any() and (qw.q == 0).any()  # ±absmax map to ±1


def test_layout_is_the_one_bitsandbytes_writes():
    """Checked against bitsandbytes' own source, without it installed: functional.py
    `QuantState.as_dict(packed=True)` (0.50.2: lines 545-579) names absmax, quant_map, nested_absmax,
    nested_quant_map and `quant_state.bitsandbytes__nf4` (the packed JSON of quant_type, blocksize,
    dtype, shape, nested_blocksize, nested_dtype, nested_offset); backends/default/ops.py
    `quantize_4bit` (lines 233-260) packs `(q[::2] << 4) | q[1::2]` as uint8 [n/2, 1]."""
    w = _weight(4, 64)
    qw = nf4_quantize(w)
    tensors = bnb_format.compress("p", qw)
    assert set(tensors) == {
        "p.weight",
        "p.weight.absmax",
        "p.weight.quant_map",
        "p.weight.quant_state.bitsandbytes__nf4",
    }
    packed = tensors["p.weight"]
    assert packed.dtype == torch.uint8 and packed.shape == (128, 1)
    flat = qw.q.reshape(-1)
    assert packed[0, 0] == (flat[0] << 4) | flat[1]  # the even element in the high nibble
    state = json.loads(bytes(tensors["p.weight.quant_state.bitsandbytes__nf4"].tolist()))
    assert state == {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [4, 64]}
    nested = bnb_format.compress("p", nf4_quantize(w, DOUBLE))
    assert nested["p.weight.absmax"].dtype == torch.uint8 and nested["p.weight.nested_quant_map"].shape == (256,)
    state = json.loads(bytes(nested["p.weight.quant_state.bitsandbytes__nf4"].tolist()))
    assert state.keys() == {
        "quant_type",
        "blocksize",
        "dtype",
        "shape",
        "nested_blocksize",
        "nested_dtype",
        "nested_offset",
    }


@pytest.mark.parametrize("double_quant", [False, True])
def test_bitsandbytes_reads_what_optkit_writes(double_quant):
    functional = pytest.importorskip("bitsandbytes.functional")
    w = _weight()
    scheme = DOUBLE if double_quant else NF4_BLOCK64
    qw = nf4_quantize(w, scheme)
    q_bnb, state_bnb = functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    tensors = {k.removeprefix("p."): v for k, v in bnb_format.compress("p", qw).items()}
    assert torch.equal(tensors["weight"], q_bnb)  # the same codes, byte for byte
    state = functional.QuantState.from_dict(
        {k.removeprefix("weight."): v for k, v in tensors.items() if k != "weight"}, "cpu"
    )
    theirs = functional.dequantize_4bit(tensors["weight"], state)
    ours = bnb_format.decompress("p", {f"p.{k}": v for k, v in tensors.items()}).dequantize()
    assert torch.equal(theirs, ours)  # what a bitsandbytes reader computes is what optkit's reader computes
    if not double_quant:
        assert torch.equal(ours, qw.dequantize()) and torch.equal(state.absmax, state_bnb.absmax)


def test_nf4_artifact_loads_in_transformers_and_the_runtime(tmp_path, draft_dir, run_cli, double_quant=True):
    """Double quantization, end to end (the plain layout is a row of the compatibility matrix)."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "nf4"
    args = ["quantize", draft_dir, "--method", "nf4", "--out", out] + (["--double-quant"] if double_quant else [])
    code, _, err = run_cli(*args)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (
        config["quant_method"] == "bitsandbytes" and config["load_in_4bit"] and config["bnb_4bit_quant_type"] == "nf4"
    )
    assert config["bnb_4bit_use_double_quant"] is double_quant
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor(f"{DOWN}.weight").dtype == torch.uint8
    result = check_transformers_load(out)
    assert result.ok, result.problems
    runtime = load_runtime_model(out)
    assert isinstance(runtime.get_submodule(DOWN), NF4Linear)
    assert evaluate(out, draft_dir, GateOptions(max_windows=4)).metrics["kld_mean"] < 0.05


def test_nf4_is_refused_where_it_cannot_be_written(tmp_path, draft_dir):
    with pytest.raises(OptkitError, match="bitsandbytes"):
        quantize_model(draft_dir, tmp_path / "q", QuantizeOptions(method="nf4", weights=NF4_BLOCK64))
    with pytest.raises(ValueError, match="writes weights.type nf4, not int"):
        QuantizeOptions(method="nf4", format="bitsandbytes", weights=WeightScheme(bits=4, group_size=64))
    with pytest.raises(ValueError, match="double_quant"):
        WeightScheme(bits=4, group_size=64, double_quant=True)
