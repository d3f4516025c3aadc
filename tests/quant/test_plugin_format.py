"""A checkpoint format is one object: a toy format registered here (no file under optkit/ names it)
is written by `quantize`, shown by `inspect`, checked by `verify`, gated by `eval`, run by
`generate`, and placed in the compatibility matrix and the vLLM spec check, from its members alone."""

import json

import pytest

from optkit.quant.formats import format_names, register_format, registered_format
from tests.quant.toy_format import ToyFormat


@pytest.fixture
def toy_format():
    with registered_format("toy", ToyFormat()) as fmt:
        yield fmt
    assert "toy" not in format_names()


@pytest.fixture
def toy_artifact(toy_format, run_cli, tmp_path, draft_dir):
    artifact = tmp_path / "toy"
    code, out, err = run_cli("quantize", draft_dir, "--method", "rtn", "--format", "toy", "--out", artifact, "--json")
    assert code == 0, err
    assert json.loads(out)["format"] == "toy"
    return artifact


def test_a_plugin_format_runs_through_inspect_verify_eval_and_generate(toy_artifact, run_cli, draft_dir):
    code, out, err = run_cli("inspect", toy_artifact)
    assert code == 0, err
    assert "where it loads (toy w4 sym" in out
    code, out, err = run_cli("verify", toy_artifact, "--json")
    assert code == 0 and json.loads(out)["ok"], err
    gate = ("eval", toy_artifact, "--baseline", draft_dir, "--max-windows", "4", "--max-kld", "1.0", "--json")
    code, out, err = run_cli(*gate)
    assert code == 0, err
    assert 0 <= json.loads(out)["metrics"]["kld_mean"] < 1.0
    code, out, err = run_cli("generate", toy_artifact, "The", "--max-tokens", "4")
    assert code == 0 and out.strip(), err


def test_the_matrix_places_a_plugin_format_by_its_loaders(toy_artifact):
    from optkit.compat import matrix
    from optkit.compat.vllm_spec import check_vllm_spec
    from optkit.modeldir import read_config, read_tensors

    config = read_config(toy_artifact)
    kind = matrix.kind_from_quant_config(config["quantization_config"])
    assert (kind.format, kind.bits, kind.symmetric, kind.w8a8) == ("toy", 4, True, False)
    rows = dict(matrix.where_it_loads(kind))
    assert rows == {loader: "loads" if loader == matrix.OPTKIT else "no" for loader in matrix.LOADERS}
    problems = check_vllm_spec(config, read_tensors(toy_artifact), {})
    assert len(problems) == 1 and "not loadable by vLLM" in problems[0]


def test_a_loader_whose_package_is_missing_is_untested(toy_format):
    from optkit.compat import matrix
    from optkit.quant.formats.kind import ArtifactKind

    toy_format.LOADERS = {"optkit": (), "transformers": ("optkit-no-such-package",)}
    kind = ArtifactKind("toy", 4, True)
    assert matrix.expected_status(kind, matrix.TRANSFORMERS) == "untested"
    assert matrix.expected_status(kind, matrix.GPTQMODEL) == "no"


def test_a_format_missing_members_is_refused_naming_them():
    class Half:
        NAME, MARKER, SUFFIXES = "half", "half_q", ("half_q",)

        def detect(self, quant_config):
            return False

    with pytest.raises(ValueError, match=r"lacks .*compress.*subclass CheckpointFormat"):
        register_format("half", Half())
    assert "half" not in format_names()


def test_an_unregistered_format_is_one_line_for_inspect(run_cli, toy_artifact, toy_format):
    from optkit.quant.formats import unregister_format

    unregister_format("toy")  # the artifact stays; no format reads it now
    code, _, err = run_cli("inspect", toy_artifact)
    register_format("toy", toy_format)  # for the fixture's teardown
    assert code == 2 and "quantization method 'toy' is not supported" in err and "Traceback" not in err
