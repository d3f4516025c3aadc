import json

import pytest
import torch

from optkit.errors import OptkitError
from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions
from optkit.modeldir import read_tensors
from optkit.quant import formats
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.formats import gptq as gptq_format
from optkit.quant.methods.gptq.math import accumulate_hessian, empty_hessian, gptq_quantize
from optkit.quant.methods.gptq.options import GPTQOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme

FAST_CALIB = CalibrationOptions(num_samples=16, seq_len=64)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_layout_round_trip_is_exact(bits, act_order):
    x = torch.randn(256, 64) * torch.linspace(0.1, 3, 64)
    hessian, _ = accumulate_hessian(*empty_hessian(64), x)
    w = torch.randn(32, 64).to(torch.bfloat16).float()
    qw = gptq_quantize(w, hessian, WeightScheme(bits=bits, group_size=16), GPTQOptions(act_order=act_order)).weight
    tensors = gptq_format.compress("p", qw)
    assert tensors["p.qweight"].shape == (64 * bits // 32, 32) and tensors["p.qweight"].dtype == torch.int32
    assert tensors["p.qzeros"].shape == (4, 32 * bits // 32) and tensors["p.scales"].dtype == torch.float16
    back = gptq_format.decompress("p", tensors, qw.scheme)
    assert torch.equal(back.q, qw.q) and torch.equal(back.zero_point, qw.zero_point)
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert (back.g_idx is None) == (qw.g_idx is None)


def test_3_bit_packing_straddles_words_like_the_reference():
    # rows 0..31 all 7 (0b111): 96 one-bits, i.e. three words of all ones
    packed = gptq_format._pack_rows(torch.full((32, 1), 7), 3)
    assert packed.flatten().tolist() == [-1, -1, -1]
    # row 10 alone: its low two bits end word 0, its high bit starts word 1
    values = torch.zeros(32, 1, dtype=torch.int64)
    values[10] = 0b101
    assert gptq_format._pack_rows(values, 3).flatten().tolist() == [1 << 30, 1, 0]


def test_symmetric_4_bit_zero_points_use_the_v1_offset():
    qw = gptq_quantize(torch.randn(32, 32), torch.eye(32), WeightScheme(bits=4, group_size=32))
    qzeros = gptq_format.compress("p", qw.weight)["p.qzeros"]
    assert (qzeros == 0x77777777).all()  # unsigned zero 8, stored as 8 - 1 = 7 in every nibble


def test_gptq_layout_refuses_what_it_cannot_store():
    with pytest.raises(OptkitError, match="symmetric weights only"):
        gptq_format.check(WeightScheme(bits=4, symmetric=False), False, [("x", 256, 256)])
    with pytest.raises(OptkitError, match="packs runs of 32"):
        gptq_format.check(WeightScheme(bits=4), False, [("x", 48, 256)])


def test_compressed_tensors_refuses_act_order_without_static_groups():
    with pytest.raises(OptkitError, match="--static-groups"):
        formats.get_format("compressed-tensors").check(WeightScheme(), "group", [])


def test_both_formats_give_the_same_gate_numbers(tmp_path, draft_dir):
    """One GPTQ quantization written twice: the gptq and compressed-tensors artifacts evaluate identically."""
    common = dict(method="gptq", weights=WeightScheme(bits=4, group_size=64), calibration=FAST_CALIB)
    ct = quantize_model(draft_dir, tmp_path / "ct", QuantizeOptions(**common))
    gq = quantize_model(draft_dir, tmp_path / "gq", QuantizeOptions(**common, format="gptq"))
    assert [layer["loss"] for layer in ct["layers"]] == [layer["loss"] for layer in gq["layers"]]
    config = json.loads((tmp_path / "gq" / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["bits"], config["group_size"], config["sym"]) == ("gptq", 4, 64, True)
    assert "model.layers.0.mlp.up_proj.qweight" in read_tensors(tmp_path / "gq")
    metrics = [evaluate(tmp_path / name, draft_dir, GateOptions(max_windows=16)).metrics for name in ("ct", "gq")]
    assert metrics[0] == metrics[1]


def test_act_order_artifact_keeps_g_idx(tmp_path, draft_dir):
    options = QuantizeOptions(
        method="gptq",
        format="gptq",
        weights=WeightScheme(bits=4, group_size=32),
        gptq=GPTQOptions(act_order=True),
        calibration=FAST_CALIB,
    )
    quantize_model(draft_dir, tmp_path / "q", options)
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    g_idx = read_tensors(tmp_path / "q")["model.layers.0.mlp.down_proj.g_idx"]
    assert config["desc_act"] is True
    assert not torch.equal(g_idx, torch.arange(g_idx.numel(), dtype=torch.int32) // 32)
    assert torch.bincount(g_idx.long()).unique().tolist() == [32]
