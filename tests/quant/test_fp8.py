"""`--method fp8`: FP8 E4M3 weights per output channel, FP8 activations, written as compressed-tensors
float-quantized, run as FP8 by the runtime and the gate, read by transformers."""

import json

import pytest
import torch
from safetensors import safe_open

from optkit.compat.transformers_load import check_transformers_load
from optkit.errors import OptkitError
from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions
from optkit.kernels.fp8 import FP8_DTYPE, FP8_MAX, FP8Linear
from optkit.models.loader import load_runtime_model
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.formats.load import load_model
from optkit.quant.methods.fp8.math import fp8_quantize
from optkit.quant.methods.smoothquant.options import SmoothQuantOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import FP8_PER_CHANNEL, W8_PER_CHANNEL

FAST_CALIB = CalibrationOptions(num_samples=8, seq_len=64)
DOWN = "model.layers.0.mlp.down_proj"


def test_weights_round_to_e4m3_with_one_scale_per_output_channel():
    w = torch.randn(16, 64) * torch.logspace(-3, 2, 16).reshape(16, 1)
    qw = fp8_quantize(w)
    assert qw.q.dtype == FP8_DTYPE and qw.scale.shape == (16, 1) and qw.scale.dtype == torch.bfloat16
    assert qw.q.float().abs().amax(dim=1).max() <= FP8_MAX
    err = (qw.dequantize() - w).abs()
    scale = qw.scale.float()
    # 3 mantissa bits: half a step is 2^-4 of the value for normal numbers, 2^-10 · scale below them
    assert (err <= torch.maximum(w.abs() * 2**-4, 2**-10 * scale) + 1e-7).all()


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_artifact_is_float_quantized_and_runs_as_fp8(tmp_path, draft_dir, activations):
    options = QuantizeOptions(
        method="fp8",
        weights=FP8_PER_CHANNEL,
        calibration=FAST_CALIB,
        fp8={"activations": activations},  # FP8 reads its own section
    )
    quantize_model(draft_dir, tmp_path / "q", options)
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    assert config["format"] == "float-quantized" and config["quant_method"] == "compressed-tensors"
    assert (group["weights"]["type"], group["weights"]["strategy"], group["weights"]["num_bits"]) == (
        "float",
        "channel",
        8,
    )
    assert group["input_activations"]["type"] == "float"
    assert group["input_activations"]["strategy"] == ("token" if activations == "dynamic" else "tensor")
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        weight = f.get_tensor(f"{DOWN}.weight")
        assert weight.dtype == FP8_DTYPE
        assert f.get_tensor(f"{DOWN}.weight_scale").shape == (weight.shape[0], 1)
        assert (f"{DOWN}.input_scale" in f.keys()) is (activations == "static")
    for model in (load_model(tmp_path / "q"), load_runtime_model(tmp_path / "q")):
        down = model.get_submodule(DOWN)
        assert isinstance(down, FP8Linear) and torch.equal(down.weight.view(torch.uint8), weight.view(torch.uint8))
        assert (down.input_scale is not None) is (activations == "static")
    assert evaluate(tmp_path / "q", draft_dir, GateOptions(max_windows=8)).metrics["kld_mean"] < 0.01


def test_transformers_round_trip_has_no_missing_or_new_keys(tmp_path, draft_dir):
    options = QuantizeOptions(method="fp8", weights=FP8_PER_CHANNEL, calibration=FAST_CALIB)
    quantize_model(draft_dir, tmp_path / "q", options)
    result = check_transformers_load(tmp_path / "q")
    assert result.ok, result.problems


def test_smoothquant_then_fp8_smooths_and_writes_fp8(tmp_path, draft_dir):
    options = QuantizeOptions(
        method=["smoothquant", "fp8"],
        weights=FP8_PER_CHANNEL,
        calibration=FAST_CALIB,
        smoothquant=SmoothQuantOptions(alpha=0.5),  # a fixed α: every norm absorbs a scale
    )
    assert options.method == "smoothquant+fp8"
    manifest = quantize_model(draft_dir, tmp_path / "q", options)
    norm_fed = [layer for layer in manifest["layers"] if layer["name"].endswith(("q_proj", "gate_proj"))]
    assert norm_fed and all(layer["alpha"] == 0.5 for layer in norm_fed)
    quantized, base = tmp_path / "q" / "model.safetensors", draft_dir / "model.safetensors"
    with safe_open(quantized, "pt") as f, safe_open(base, "pt") as b:
        assert f.get_tensor(f"{DOWN}.weight").dtype == FP8_DTYPE
        norm = "model.layers.0.post_attention_layernorm.weight"
        assert not torch.equal(f.get_tensor(norm).float(), b.get_tensor(norm).float())  # the norm absorbed 1/s


def test_fp8_refuses_other_schemes_and_int_methods_refuse_fp8(tmp_path, draft_dir):
    with pytest.raises(ValueError, match="fp8 e4m3 per output channel"):
        QuantizeOptions(method="fp8", weights=W8_PER_CHANNEL)
    with pytest.raises(ValueError, match="writes weights.type int, not float .written by method fp8"):
        QuantizeOptions(method="rtn", weights=FP8_PER_CHANNEL)
    with pytest.raises(OptkitError):
        quantize_model(draft_dir, tmp_path / "q", QuantizeOptions(method="fp8", weights=FP8_PER_CHANNEL, format="gptq"))
    assert not (tmp_path / "q").exists()
