import json

import pytest
import torch
from safetensors import safe_open

from optkit.families.llama import LLAMA
from optkit.gate.evaluate import evaluate
from optkit.gate.options import GateOptions
from optkit.kernels.w8a8 import W8A8Linear
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.formats.load import load_model
from optkit.quant.layer_step import fold_scale
from optkit.quant.methods.smoothquant import math as sq
from optkit.quant.methods.smoothquant.options import SmoothQuantOptions
from optkit.quant.methods.smoothquant.step import search_folds
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.zoo.outliers import add_activation_outliers

FAST_CALIB = CalibrationOptions(num_samples=8, seq_len=64)


def test_smoothing_scales_follow_the_formula():
    act = torch.tensor([1.0, 4.0, 16.0])
    w = [torch.tensor([[1.0, 1.0, 4.0]]), torch.tensor([[-2.0, 0.5, 1.0]])]
    s = sq.smoothing_scales(act, w, alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([1 / 2**0.5, 2.0, 2.0]))
    assert torch.allclose(sq.smoothing_scales(act, w, alpha=1.0), act)


def _paired_diffs(n: int, t: float) -> torch.Tensor:
    """n differences (n even) whose paired t statistic, mean / (std / √n), is t."""
    spread = torch.tensor([-1.0, 1.0]).repeat(n // 2)  # mean 0
    diffs = spread + t * spread.std() / n**0.5
    assert abs(diffs.mean() / (diffs.std() / n**0.5) - t) < 1e-4
    return diffs


def test_smoothing_is_kept_only_where_its_gain_passes_a_paired_t_test():
    plain = torch.tensor([1.0, 2.0, 1.5, 3.0])
    assert sq.gain_holds(plain * 0.9, plain)  # 10% lower on every sample: t = −4.4
    # lower by 0.05 on average, but the paired differences (-0.4, +0.3, -0.3, +0.2) have a standard error of 0.18
    assert not sq.gain_holds(plain + torch.tensor([-0.4, 0.3, -0.3, 0.2]), plain)
    assert not sq.gain_holds(plain * 1.1, plain)
    assert not sq.gain_holds(plain, plain)
    # t = −2.5: short of Student's 3.18 on 4 samples (3 degrees of freedom), past 2.04 on 32
    assert not sq.gain_holds(plain + 0.01 * _paired_diffs(4, -2.5), plain)
    assert sq.gain_holds(plain.repeat(8) + 0.01 * _paired_diffs(32, -2.5), plain.repeat(8))
    one = torch.tensor([1.0])
    assert sq.gain_holds(one * 0.99, one) and not sq.gain_holds(one * 1.01, one)


@pytest.mark.parametrize("num_search, num_samples", [(8, 8), (5, 32), (2, 2)])
def test_each_search_half_is_scored_with_scales_from_the_samples_outside_it(num_search, num_samples):
    (choose, choose_from), (check, check_from) = search_folds(num_search, num_samples)
    scored = [set(range(num_samples)[choose]), set(range(num_samples)[check])]
    assert scored[0] and scored[1] and not scored[0] & scored[1] and scored[0] | scored[1] == set(range(num_search))
    for half, scales_from in zip(scored, (choose_from, check_from), strict=True):
        assert set(torch.nonzero(scales_from).flatten().tolist()) == set(range(num_samples)) - half


def test_one_search_sample_is_scored_with_its_own_scales():
    [(scored, scales_from)] = search_folds(1, 4)
    assert range(4)[scored] == range(1) and scales_from.all()


def test_smoothing_leaves_the_full_precision_model_unchanged(draft_dir):
    """Acceptance: scales folded into the norms, logits unchanged within 1e-4 before quantization."""
    model = load_model(draft_dir)
    tokens = torch.randint(0, model.config.vocab_size, (2, 40))
    with torch.inference_mode():
        expected = model(tokens).logits
        for layer in model.model.layers:
            for previous, linears, _ in LLAMA.norm_groups:
                weights = [layer.get_submodule(n).weight for n in linears]
                act = torch.rand(weights[0].shape[1]) * 50 + 0.1
                fold_scale(layer, previous, linears, sq.smoothing_scales(act, weights, 0.5))
        torch.testing.assert_close(model(tokens).logits, expected, atol=1e-4, rtol=1e-4)


def test_the_outlier_model_has_the_same_function_and_real_outliers(tmp_path, draft_dir):
    out = add_activation_outliers(draft_dir, tmp_path / "outliers")
    base, outliers = load_model(draft_dir), load_model(out)
    tokens = torch.randint(0, base.config.vocab_size, (2, 40))
    with torch.inference_mode():
        torch.testing.assert_close(outliers(tokens).logits, base(tokens).logits, atol=1e-4, rtol=1e-4)
    norm = outliers.model.layers[0].input_layernorm.weight
    assert norm.abs().max() / norm.abs().median() > 20


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_w8a8_artifact_is_int8_on_disk_and_in_memory(tmp_path, draft_dir, activations):
    options = QuantizeOptions(
        method="smoothquant",
        weights=sq.W8_PER_CHANNEL,
        calibration=FAST_CALIB,
        smoothquant=SmoothQuantOptions(activations=activations),
    )
    manifest = quantize_model(draft_dir, tmp_path / "q", options)
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    assert config["format"] == "int-quantized"
    assert group["input_activations"]["dynamic"] is (activations == "dynamic")
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 8
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        weight = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        assert weight.dtype == torch.int8
        assert ("model.layers.0.mlp.down_proj.input_scale" in f.keys()) is (activations == "static")
    assert all(0 <= layer["alpha"] <= 1 for layer in manifest["layers"] if "alpha" in layer)
    model = load_model(tmp_path / "q")
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, W8A8Linear) and torch.equal(down.weight_t.T, weight)
    assert evaluate(tmp_path / "q", draft_dir, GateOptions(max_windows=8)).metrics["kld_mean"] < 0.01


def test_transformers_loads_the_w8a8_artifact(tmp_path, draft_dir):
    from transformers import AutoModelForCausalLM

    options = QuantizeOptions(method="smoothquant", weights=sq.W8_PER_CHANNEL, calibration=FAST_CALIB)
    quantize_model(draft_dir, tmp_path / "q", options)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32).eval()
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, 64))
    with torch.inference_mode():
        ours, theirs = load_model(tmp_path / "q")(tokens).logits, hf_model(tokens).logits
    # transformers emulates int8 activations with its own rounding convention (absmax / 127.5)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.95


@pytest.mark.slow
def test_smoothquant_acceptance_on_small(tmp_path, small_dir, small_outliers_dir):
    """W8A8 on `small` costs ≤ 1% perplexity; on the outlier copy, plain W8A8 loses ≥ 3× SmoothQuant's."""

    def ppl_increase(model, method: str) -> float:
        out = tmp_path / f"{method}-{model.name}"
        quantize_model(model, out, QuantizeOptions(method=method, weights=sq.W8_PER_CHANNEL))
        return evaluate(out, model, GateOptions()).metrics["ppl_increase_pct"]

    assert ppl_increase(small_dir, "smoothquant") <= 1.0
    smooth, plain = ppl_increase(small_outliers_dir, "smoothquant"), ppl_increase(small_outliers_dir, "w8a8")
    assert plain >= 3 * max(smooth, 1e-3)


def test_a_w8a8_artifact_dequantizes_into_a_plain_checkpoint(tmp_path, draft_dir):
    """vLLM's bf16 tolerance measures vLLM on the artifact's weights as a plain checkpoint
    (compat/vllm_load.write_dense_copy): each int8 weight times its per-channel scale, no scale left."""
    from optkit.compat.vllm_load import write_dense_copy
    from optkit.modeldir import read_config, read_tensors

    options = QuantizeOptions(method="smoothquant", weights=sq.W8_PER_CHANNEL, calibration=FAST_CALIB)
    quantize_model(draft_dir, tmp_path / "q", options)
    dense = write_dense_copy(tmp_path / "q", tmp_path / "dense")
    stored, plain = read_tensors(tmp_path / "q"), read_tensors(dense)
    name = "model.layers.0.mlp.down_proj"
    expected = stored[f"{name}.weight"].float() * stored[f"{name}.weight_scale"].float().reshape(-1, 1)
    assert plain[f"{name}.weight"].dtype == torch.float32 and torch.equal(plain[f"{name}.weight"], expected)
    assert not any(k.endswith(("weight_scale", "input_scale")) for k in plain)
    assert "quantization_config" not in read_config(dense)
    tokens = torch.randint(0, 256, (1, 32))
    with torch.inference_mode():  # the same weights; only the int8 activations' rounding differs
        ours, theirs = load_model(tmp_path / "q")(tokens).logits, load_model(dense)(tokens).logits
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9
