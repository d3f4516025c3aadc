"""Gemma 2, Gemma 3 and the multimodal Gemma 3 (families/gemma.py) through every method, verify
and the runtime, on tiny random models whose windows, soft-caps and (1 + w) norms bind
(tests/tiny_families.py). Quality is measured on held-out text (calibration is on `calib`)."""

import json
import logging

import pytest
import torch

from optkit.families import family_for
from optkit.gate.metrics import full_kld
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.methods.awq.options import AWQOptions
from optkit.quant.methods.smoothquant.options import SmoothQuantOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.models.paged import run_paged, whole_prefills
from tests.quant.paired_kld import assert_no_worse, heldout_windows, window_klds
from tests.tiny_families import TINY, save_tiny_family

CALIB = CalibrationOptions(num_samples=32, seq_len=64)  # 2048 tokens for 128 input channels
FAMILY_NAMES = ("gemma2", "gemma3_text", "gemma3")
W4 = WeightScheme(bits=4, group_size=64)
W8_CHANNEL = WeightScheme(bits=8, group_size=-1, symmetric=True)
OUTLIER_CHANNELS, OUTLIER_FACTOR = (3, 40, 77, 101), 32.0


@pytest.fixture(scope="module")
def family_model(tmp_path_factory, draft_dir):
    made = {}

    def make(name: str, outliers: bool = False):
        key = (name, outliers)
        if key not in made:
            path = save_tiny_family(name, tmp_path_factory.mktemp("gemma") / name, draft_dir)
            made[key] = _with_outliers(path) if outliers else path
        return made[key]

    return make


def _with_outliers(path):
    """The same function with activation outliers, as large models have: a few channels of each
    norm that feeds linears scaled by c (Gemma's (1 + w)·c, i.e. w ← (1 + w)·c − 1) and the matching
    input columns of the linears divided by c."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    channels = list(OUTLIER_CHANNELS)
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            for norm, linears in (
                (layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)),
                (layer.pre_feedforward_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj)),
            ):
                norm.weight[channels] = (1 + norm.weight[channels]) * OUTLIER_FACTOR - 1
                for linear in linears:
                    linear.weight[:, channels] /= OUTLIER_FACTOR
    out = path.parent / f"{path.name}-outliers"
    model.save_pretrained(out)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (out / file).write_bytes((path / file).read_bytes())
    return out


def _heldout_sequences(path) -> list[list[int]]:
    from optkit.data.eval_sets import load_text_set
    from optkit.data.packing import tokenize_stream
    from optkit.modeldir import load_tokenizer

    stream = tokenize_stream(load_tokenizer(path), load_text_set("heldout").texts[:40])
    return [stream[i * 64 : (i + 1) * 64].tolist() for i in range(8)]


def _runtime_logits(path, sequences):
    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(path)
    return torch.cat(run_paged(model, sequences, whole_prefills([len(s) for s in sequences]), block_size=16))


def _mean_kld(base, artifact) -> float:
    sequences = _heldout_sequences(base)
    return full_kld(_runtime_logits(base, sequences), _runtime_logits(artifact, sequences)).mean().item()


def _quantize(base, out, method: str, weights: WeightScheme, **sections):
    quantize_model(base, out, QuantizeOptions(method=method, weights=weights, calibration=CALIB, **sections))
    return out


def test_the_families_are_registered_with_their_norms():
    from optkit.families import model_types

    for model_type in ("gemma2", "gemma3_text", "gemma3"):
        family = family_for(model_type)
        assert (
            family.name.startswith("gemma")
            and model_type in model_types(runtime=True)
            and family.norm_weight_offset == 1.0
        )
        # the norms that feed linears: not post_attention_layernorm, which normalizes the attention's output
        assert [g[0] for g in family.norm_groups] == ["input_layernorm", "pre_feedforward_layernorm"]


@pytest.mark.parametrize("offset", [1.0, 0.0])
def test_a_smoothing_scale_folds_into_a_gemma_norm_without_changing_the_layer(family_model, offset):
    """w ← (1 + w)/s − 1 keeps the decoder layer's function; the plain fold w ← w/s (offset 0,
    Llama's) does not: the check can fail."""
    from optkit.quant.calibrate import LayerStream
    from optkit.quant.layer_step import fold_scale

    stream = LayerStream(family_model("gemma2"), torch.device("cpu"))
    layer = stream.load_layer(0)
    rope, mask = stream.layer_inputs(0, 24)
    x = torch.randn(2, 24, TINY["hidden_size"])
    with torch.no_grad():
        before = layer(x, position_embeddings=rope, attention_mask=mask)
        for norm, linears, _ in stream.family.norm_groups:
            s = torch.rand(TINY["hidden_size"]) * 3 + 0.25
            fold_scale(layer, norm, linears, s, offset)
        after = layer(x, position_embeddings=rope, attention_mask=mask)
    if offset:
        torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    else:
        assert (after - before).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_calibration_feeds_the_first_layer_what_the_model_does(family_model, family):
    """Gemma multiplies its embeddings by √hidden_size (rounded to the model's dtype)."""
    from transformers import AutoModelForCausalLM

    from optkit.quant.calibrate import LayerStream

    path = family_model(family)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path)(tokens, output_hidden_states=True).hidden_states[0]
    torch.testing.assert_close(LayerStream(path, torch.device("cpu")).embed(tokens), expected)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize(("method", "bits"), [("rtn", 8), ("gptq", 4)])
def test_artifacts_quantize_verify_and_match_transformers_in_the_runtime(
    tmp_path, family_model, run_cli, family, method, bits
):
    """`verify --load transformers` loads the artifact in transformers and compares its logits with
    optkit's runtime on the same artifact; RTN w8 stays within 1e-3 mean KLD of its base."""
    out = tmp_path / "artifact"
    weights = WeightScheme(bits=bits, group_size=64)
    quantize_model(
        family_model(family),
        out,
        QuantizeOptions(method=method, weights=weights, calibration=CALIB.model_copy(update={"num_samples": 8})),
    )
    code, stdout, _ = run_cli("verify", str(out), "--load", "transformers")
    assert code == 0, stdout
    if method == "rtn":
        assert _mean_kld(family_model(family), out) <= 1e-3


def test_the_multimodal_artifact_keeps_the_vision_tower_in_full_precision(tmp_path, family_model, caplog):
    from safetensors import safe_open

    from optkit.models.loader import load_runtime_model

    base, out = family_model("gemma3"), tmp_path / "artifact"
    quantize_model(base, out, QuantizeOptions(method="rtn", weights=W4))
    with safe_open(out / "model.safetensors", "pt") as artifact, safe_open(base / "model.safetensors", "pt") as full:
        vision = [k for k in full.keys() if k.startswith(("vision_tower.", "multi_modal_projector."))]
        assert vision and all(torch.equal(artifact.get_tensor(k), full.get_tensor(k)) for k in vision)
        assert "language_model.model.layers.0.mlp.down_proj.weight_packed" in artifact.keys()
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "lm_head" in ignore and any(name.startswith("model.vision_tower.") for name in ignore)
    with caplog.at_level(logging.INFO, logger="optkit.models.loader"):
        load_runtime_model(out)
    assert any("vision_tower" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gptq_and_awq_w4_beat_rtn_w4(tmp_path, family_model, family):
    base = family_model(family, outliers=True)
    rtn = _mean_kld(base, _quantize(base, tmp_path / "rtn", "rtn", W4))
    gptq = _mean_kld(base, _quantize(base, tmp_path / "gptq", "gptq", W4))
    awq = _mean_kld(base, _quantize(base, tmp_path / "awq", "awq", W4, awq=AWQOptions(grid=8, search_samples=8)))
    assert gptq < rtn and awq <= rtn, (gptq, awq, rtn)


@pytest.mark.slow
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_smoothquant_is_no_worse_than_plain_w8a8_and_better_with_outliers(tmp_path, family_model, family, outliers):
    """Without outliers SmoothQuant (α searched per group, no smoothing among the choices) is no worse
    than plain W8A8 on 48 held-out windows (a paired test: the two differ by less than 8 windows'
    noise, tests/quant/paired_kld.py); with activation outliers (as large models have) it is better."""
    base = family_model(family, outliers=outliers)
    windows = heldout_windows(base)
    plain = window_klds(base, _quantize(base, tmp_path / "w8a8", "w8a8", W8_CHANNEL), windows)
    sq = _quantize(base, tmp_path / "sq", "smoothquant", W8_CHANNEL, smoothquant=SmoothQuantOptions(search_samples=8))
    smooth = window_klds(base, sq, windows)
    if outliers:
        assert smooth.mean() < plain.mean(), (smooth.mean(), plain.mean())
    else:
        assert_no_worse(smooth, plain)
