"""A quantized artifact's tensors are untrusted (issue 30, sections 5 and 7): each layer's tensors
are checked against each other and against config.json when it is loaded, on every device, before
any kernel reads them (the Triton W4A16 kernel takes N from the scales and would read past a
shorter qweight). A mismatch is one OptkitError naming the layer and the tensor, from the runtime's
loader and from the evaluation loader alike, and one line with exit 2 on the command line."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from optkit.artifacts import file_sha256
from optkit.errors import OptkitError
from optkit.models.loader import load_runtime_model
from optkit.quant.formats.load import load_model
from tests.cli.test_bad_input import assert_user_error

Q = "model.layers.0.self_attn.q_proj"
STATE = f"{Q}.weight.quant_state.bitsandbytes__nf4"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, draft_dir):
    """RTN 4-bit artifacts of `draft` in the weight-only formats, and an FP8 one (quantized once)."""
    from optkit.quant.methods.nf4.math import NF4_BLOCK64
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import FP8_PER_CHANNEL

    options = {
        "compressed-tensors": QuantizeOptions(),
        "gptq": QuantizeOptions(format="gptq"),
        "fp8": QuantizeOptions(method="fp8", weights=FP8_PER_CHANNEL),
        "bitsandbytes": QuantizeOptions(method="nf4", format="bitsandbytes", weights=NF4_BLOCK64),
    }
    root = tmp_path_factory.mktemp("artifacts")
    for name, option in options.items():
        quantize_model(draft_dir, root / name, option)
    return root


def tampered(source, target, edit):
    """A copy of the artifact `source` whose tensors `edit` changed in place, with a manifest that
    lists the new file's sha256 (whoever crafts an artifact can write one)."""
    import shutil

    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    with safe_open(weights, framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})
    manifest = json.loads((target / "optkit.json").read_text())
    manifest["files"]["model.safetensors"] = file_sha256(weights)
    (target / "optkit.json").write_text(json.dumps(manifest))
    return target


def _set_state(tensors, change):
    state = json.loads(bytes(tensors[STATE].tolist()))
    state = change(state)
    tensors[STATE] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


def _set(key, make):
    def edit(tensors):
        tensors[key] = make(tensors)

    return edit


# case -> (the artifact's format, the edit, what the error line names besides the layer)
CASES = {
    # compressed-tensors: the packed weight and its recorded shape say 120 rows, the scales 128
    "ct: weight with fewer rows than its scales": (
        "compressed-tensors",
        lambda t: t.update(
            {
                f"{Q}.weight_shape": torch.tensor([120, 128]),
                f"{Q}.weight_packed": t[f"{Q}.weight_packed"][:120].clone(),
            }
        ),
        "scales",
    ),
    "ct: a weight_shape of one dimension": (
        "compressed-tensors",
        _set(f"{Q}.weight_shape", lambda t: torch.tensor([128])),
        "do not fit together",
    ),
    "ct: a bias of the wrong length": ("compressed-tensors", _set(f"{Q}.bias", lambda t: torch.zeros(100)), "bias"),
    "gptq: qweight with fewer outputs than the scales": (
        "gptq",
        _set(f"{Q}.qweight", lambda t: t[f"{Q}.qweight"][:, :120].clone()),
        "scales",
    ),
    "gptq: qzeros that do not match the scales": (
        "gptq",
        _set(f"{Q}.qzeros", lambda t: t[f"{Q}.qzeros"][:, :8].clone()),
        "zero points",
    ),
    "gptq: g_idx naming a group past the scales": (
        "gptq",
        _set(f"{Q}.g_idx", lambda t: torch.where(torch.arange(128) == 5, 7, t[f"{Q}.g_idx"]).int()),
        "g_idx",
    ),
    "gptq: scales missing": ("gptq", lambda t: t.pop(f"{Q}.scales"), "lacks"),
    "fp8: weight_scale of the wrong length": (
        "fp8",
        _set(f"{Q}.weight_scale", lambda t: t[f"{Q}.weight_scale"][:64].clone()),
        "weight_scale",
    ),
    "nf4: blocksize 0": ("bitsandbytes", lambda t: _set_state(t, lambda s: {**s, "blocksize": 0}), "blocksize"),
    "nf4: a shape larger than the tensor": (
        "bitsandbytes",
        lambda t: _set_state(t, lambda s: {**s, "shape": [4096, 128]}),
        "4096×128",
    ),
    "nf4: the quant state a list": ("bitsandbytes", lambda t: _set_state(t, lambda s: [s]), "not a JSON object"),
    "nf4: absmax of the wrong length": (
        "bitsandbytes",
        _set(f"{Q}.weight.absmax", lambda t: t[f"{Q}.weight.absmax"][:3].clone()),
        "absmax",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_layer_whose_tensors_disagree_is_refused_at_load(case, artifacts, tmp_path):
    fmt, edit, fragment = CASES[case]
    artifact = tampered(artifacts / fmt, tmp_path / "tampered", edit)
    with pytest.raises(OptkitError, match=Q) as refused:
        load_runtime_model(artifact, prepare=False)  # on the CPU, before any forward
    assert fragment in str(refused.value)
    with pytest.raises(OptkitError, match=Q) as refused:
        load_model(artifact)  # the gate's loader
    assert fragment in str(refused.value)


@pytest.mark.parametrize("case", ["gptq: qweight with fewer outputs than the scales", "nf4: blocksize 0"])
def test_generate_and_eval_on_such_an_artifact_are_one_line(case, artifacts, tmp_path, run_cli, draft_dir):
    fmt, edit, fragment = CASES[case]
    artifact = tampered(artifacts / fmt, tmp_path / "tampered", edit)
    assert_user_error(run_cli("generate", artifact, "hi", "--max-tokens", "2"), Q, fragment)
    assert_user_error(run_cli("eval", artifact, "--baseline", draft_dir), Q, fragment)


def test_zero_size_weights_under_a_valid_config_are_refused(artifacts, tmp_path):
    """A full-precision tensor whose shape config.json does not give (here: the final norm, empty)."""
    artifact = tampered(artifacts / "gptq", tmp_path / "tampered", _set("model.norm.weight", lambda t: torch.ones(0)))
    with pytest.raises(OptkitError, match=r"model\.norm\.weight is \[0\]"):
        load_runtime_model(artifact, prepare=False)
    with pytest.raises(OptkitError, match=r"model\.norm\.weight is \[0\]"):
        load_model(artifact)


@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq", "fp8", "bitsandbytes"])
def test_the_untampered_artifacts_load(artifacts, fmt):
    assert load_runtime_model(artifacts / fmt).config.hidden_size == 128
    assert load_model(artifacts / fmt).config.hidden_size == 128
