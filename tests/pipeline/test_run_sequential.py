"""A recipe's `gate.sequential: true`: the release gate stops once its threshold is decided."""

import json

from tests.pipeline.test_run_verdicts import write


def test_a_sequential_recipe_gate_releases_on_a_fraction_of_its_windows(run_cli, tmp_path, draft_dir):
    gate = {"max_windows": 64, "seq_len": 64, "max_kld": 0.5, "sequential": True}
    code, out, err = run_cli("run", write(tmp_path, draft_dir, gate), "--json")
    assert code == 0, err
    released = json.loads((tmp_path / "release" / "gate.json").read_text())
    assert released["verdict"] == "pass" and released["sequential"]["windows_available"] == 64
    assert released["eval_set"]["windows"] == released["sequential"]["windows"] <= 24


def test_a_sequential_recipe_gate_without_a_threshold_is_refused_naming_the_key(run_cli, tmp_path, draft_dir):
    code, out, err = run_cli("run", write(tmp_path, draft_dir, {"max_windows": 4, "sequential": True}))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "gate" in err
