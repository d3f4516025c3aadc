"""A calibrated method with its own option and flag, registered from outside optkit (toy_method.py,
one module): `optkit quantize` takes its flag and `optkit run` its recipe section, and `eval` and
`generate` run on the artifact."""

import json

import pytest
import yaml

from optkit.quant import methods
from tests.quant.toy_method import TOYCLIP


@pytest.fixture
def toyclip():
    with methods.registered_method(TOYCLIP):
        yield
    assert "toyclip" not in methods.method_names()


def test_a_plugin_method_runs_from_its_flag_and_its_recipe_section(toyclip, run_cli, tmp_path, draft_dir):
    code, out, _ = run_cli("quantize", "--help")
    assert code == 0 and "toyclip" in out and "--toy-clip" in out

    artifact = tmp_path / "flag"
    args = ("--method", "toyclip", "--num-samples", "4", "--seq-len", "32", "--group-size", "64")
    code, out, err = run_cli("quantize", draft_dir, *args, "--toy-clip", "0.9", "--out", artifact, "--json")
    assert code == 0, err
    manifest = json.loads(out)
    assert manifest["method"] == "toyclip" and manifest["options"]["toyclip"] == {"clip": 0.9}
    assert manifest["calibration"]["num_samples"] == 4  # a calibrated method: the data was read
    assert all(layer["toy_tokens"] == 4 * 32 for layer in manifest["layers"])

    code, _, err = run_cli("quantize", draft_dir, *args, "--toy-clip", "1.5", "--out", tmp_path / "bad")
    assert code == 2 and "--toy-clip 1.5 is invalid" in err  # its own model's check, naming its flag

    recipe = {
        "model": str(draft_dir),
        "quantize": {
            "method": "toyclip",
            "toyclip": {"clip": 0.8},
            "weights": {"bits": 4, "group_size": 64},
            "calibration": {"num_samples": 4, "seq_len": 32},
        },
        "gate": {"max_windows": 4, "max_kld": 1.0, "max_ppl_increase": 100, "min_top1": 0},
        "output": str(tmp_path / "release"),
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    code, out, err = run_cli("run", tmp_path / "recipe.yaml", "--json")
    assert code == 0, err
    released = json.loads((tmp_path / "release" / "optkit.json").read_text())
    assert released["options"]["toyclip"] == {"clip": 0.8}

    code, out, err = run_cli("eval", artifact, "--baseline", draft_dir, "--max-windows", "4", "--json")
    assert code in (0, 1), err  # a verdict either way: the artifact was scored
    assert json.loads(out)["metrics"]["kld_mean"] >= 0
    code, out, err = run_cli("generate", artifact, "def f():", "--max-tokens", "3", "--device", "cpu")
    assert code == 0 and out.strip(), err


def test_a_plugin_section_error_names_its_recipe_key(toyclip, tmp_path, draft_dir):
    from optkit.errors import OptkitError
    from optkit.pipeline.recipe import parse_recipe

    data = {"model": "draft", "quantize": {"method": "toyclip", "toyclip": {"clipp": 0.5}}, "output": "x"}
    with pytest.raises(OptkitError, match=r"recipe key 'quantize\.toyclip\.clipp' is unknown: did you mean 'clip'"):
        parse_recipe(data, "r.yaml")
