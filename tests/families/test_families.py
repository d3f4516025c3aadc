"""Granite 3 and OLMo 2 (families/) through quantize, verify and the runtime, on tiny random
models whose multipliers and norms bind (tests/tiny_families.py)."""

import logging

import pytest
import torch

from optkit.families import family_for, model_types
from optkit.gate.metrics import full_kld
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.models.paged import run_paged, whole_prefills
from tests.tiny_families import TINY, save_tiny_family

CALIB = CalibrationOptions(num_samples=8, seq_len=64)
FAMILY_NAMES = ("granite", "olmo2")


@pytest.fixture(scope="module")
def family_model(tmp_path_factory, draft_dir):
    made = {}

    def make(name: str):
        if name not in made:
            made[name] = save_tiny_family(name, tmp_path_factory.mktemp("families") / name, draft_dir)
        return made[name]

    return make


def _runtime_logits(path, sequences):
    from optkit.models.loader import load_runtime_model

    model = load_runtime_model(path)
    return torch.cat(run_paged(model, sequences, whole_prefills([len(s) for s in sequences]), block_size=16))


def _mean_kld(base, artifact) -> float:
    torch.manual_seed(1)
    sequences = [torch.randint(0, TINY["vocab_size"], (n,)).tolist() for n in (48, 31, 64)]
    return full_kld(_runtime_logits(base, sequences), _runtime_logits(artifact, sequences)).mean().item()


def test_the_families_are_registered_for_quantization_and_the_runtime():

    assert family_for("granite").name == "granite" and family_for("olmo2").name == "olmo2"
    assert {"granite", "olmo2"} <= set(model_types(runtime=True))
    # OLMo 2 has no pre-norm: only the linear-fed groups are left to AWQ, none to SmoothQuant
    assert family_for("olmo2").norm_groups == ()


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize(("method", "bits"), [("rtn", 8), ("gptq", 4)])
def test_artifacts_quantize_verify_and_match_transformers_in_the_runtime(
    tmp_path, family_model, run_cli, family, method, bits
):
    out = tmp_path / "artifact"
    options = QuantizeOptions(method=method, weights=WeightScheme(bits=bits, group_size=64), calibration=CALIB)
    quantize_model(family_model(family), out, options)
    code, stdout, _ = run_cli("verify", str(out), "--load", "transformers")
    assert code == 0, stdout


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_rtn_w8_stays_within_the_kld_gate_of_its_base(tmp_path, family_model, family):
    out = tmp_path / "artifact"
    quantize_model(family_model(family), out, QuantizeOptions(method="rtn", weights=WeightScheme(bits=8)))
    assert _mean_kld(family_model(family), out) <= 1e-3


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_calibration_feeds_the_first_layer_what_the_model_does(family_model, family):
    """Granite multiplies its embeddings by embedding_multiplier before the first layer."""
    from transformers import AutoModelForCausalLM

    from optkit.quant.calibrate import LayerStream

    path = family_model(family)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(path)(tokens, output_hidden_states=True).hidden_states[0]
    torch.testing.assert_close(LayerStream(path, torch.device("cpu")).embed(tokens), expected)


def test_olmo2_awq_says_which_groups_it_cannot_smooth(tmp_path, family_model, caplog):
    from optkit.quant.methods.awq.options import AWQOptions

    options = QuantizeOptions(
        method="awq",
        weights=WeightScheme(bits=4, group_size=64),
        calibration=CALIB,
        awq=AWQOptions(grid=4, clip_steps=4),
    )
    with caplog.at_level(logging.WARNING, logger="optkit.families"):
        quantize_model(family_model("olmo2"), tmp_path / "awq", options)
    lines = [r.getMessage() for r in caplog.records if "unsmoothed" in r.getMessage()]
    assert lines == [
        "olmo2: AWQ leaves self_attn.q_proj, self_attn.k_proj, self_attn.v_proj unsmoothed: "
        "OLMo 2 has no norm on the sublayer's input to fold a scale into",
        "olmo2: AWQ leaves mlp.gate_proj, mlp.up_proj unsmoothed: "
        "OLMo 2 has no norm on the sublayer's input to fold a scale into",
    ]
