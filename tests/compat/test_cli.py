"""`optkit verify --load transformers`, `optkit inspect` and `optkit quantize` speak from the matrix."""

import pytest

from optkit.compat import matrix
from optkit.quant.formats.kind import ArtifactKind


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, draft_dir):
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    out = {}
    for symmetric in (True, False):
        path = tmp_path_factory.mktemp("cli") / f"w4-{'sym' if symmetric else 'asym'}"
        quantize_model(draft_dir, path, QuantizeOptions(weights=WeightScheme(bits=4, symmetric=symmetric)))
        out[symmetric] = path
    return out


def test_verify_load_transformers_passes_a_loadable_artifact(run_cli, artifacts):
    code, out, _ = run_cli("verify", artifacts[True], "--load", "transformers")
    assert code == 0, out
    assert "loads in transformers" in out


def test_verify_load_transformers_exits_1_where_the_matrix_expects_a_failure(run_cli, artifacts):
    expected = matrix.expected_status(ArtifactKind("compressed-tensors", 4, False), matrix.TRANSFORMERS)
    code, out, _ = run_cli("verify", artifacts[False], "--load", "transformers", "--json")
    assert code == (1 if expected == "fails" else 0), out
    if expected == "fails":
        assert "MISMATCH" in out


def test_verify_refuses_an_unknown_loader_with_exit_2(run_cli, artifacts):
    code, _, err = run_cli("verify", artifacts[True], "--load", "llama.cpp")
    assert code == 2
    assert "--load transformers" in err


def test_inspect_says_where_the_artifact_loads(run_cli, artifacts):
    code, out, _ = run_cli("inspect", artifacts[False])
    assert code == 0
    flat = " ".join(out.split())
    assert "where it loads" in flat and "by spec" in flat
