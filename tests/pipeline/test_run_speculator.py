"""A recipe's `speculator:` section: the release ships an EAGLE head trained on its artifact, listed
in its manifest and checked by `optkit verify`, and gate.min_acceptance_length rejects (exit 1) a
release whose head falls short."""

import json

from tests.cli.test_bad_input import assert_user_error
from tests.pipeline.test_run import stage_status, write_recipe

TINY_SPECULATOR = {
    "steps": 2,
    "batch_size": 2,
    "seq_len": 32,
    "warmup_steps": 1,
    "eval_prompts": 2,
    "eval_new_tokens": 12,
    "num_speculative_tokens": 3,
}


def speculator_recipe(tmp_path, draft_dir, min_acceptance_length):
    return write_recipe(
        tmp_path,
        draft_dir,
        quantize={"method": "rtn", "weights": {"bits": 8, "group_size": 64, "symmetric": True}},
        gate={"max_windows": 2, "max_kld": 1.0, "min_acceptance_length": min_acceptance_length},
        speculator=TINY_SPECULATOR,
    )


def test_the_release_ships_the_head_and_the_gate_rejects_too_low_an_acceptance(run_cli, tmp_path, draft_dir):
    recipe = speculator_recipe(tmp_path, draft_dir, 1.0)
    code, out, err = run_cli("run", recipe, "--json")
    assert code == 0, err
    assert stage_status((code, out)) == {"quantize": "ran", "gate": "ran", "speculator": "ran", "package": "ran"}
    release = tmp_path / "release"
    manifest = json.loads((release / "optkit.json").read_text())
    assert {"speculator/config.json", "speculator/model.safetensors"} <= set(manifest["files"])
    assert manifest["speculator"]["path"] == "speculator"
    speculative = json.loads((release / "gate.json").read_text())["speculative"]
    for measured in ("base_head_on_base", "base_head_on_artifact", "artifact_head_on_artifact"):
        assert 1.0 <= speculative[measured] <= 4.0
    assert speculative["check"]["passed"] and speculative["num_speculative_tokens"] == 3
    assert run_cli("verify", release)[0] == 0

    # an acceptance no head reaches at k=3 (at most 4 tokens a step): rejected, heads not retrained
    code, out, _ = run_cli("run", recipe, "--set", "gate.min_acceptance_length=4.0", "--json")
    assert code == 1 and json.loads(out)["verdict"] == "rejected"
    gate = json.loads((release / "gate.json").read_text())
    assert gate["verdict"] == "fail" and not gate["speculative"]["check"]["passed"]
    assert any(c["name"] == "min_acceptance_length" and not c["passed"] for c in gate["checks"])

    weights = release / "speculator" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)  # a changed head is caught
    code, _, err = run_cli("verify", release)
    assert code != 0 and "speculator/model.safetensors" in err + _


def test_min_acceptance_length_without_a_speculator_names_the_section(run_cli, tmp_path, draft_dir):
    recipe = write_recipe(tmp_path, draft_dir, gate={"max_kld": 0.05, "min_acceptance_length": 2.0})
    assert_user_error(run_cli("run", recipe), "min_acceptance_length", "speculator")
