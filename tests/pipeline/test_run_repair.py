"""`optkit run` with `gate.repair`: the release is the repaired artifact, its card names the layers
kept at higher precision and why, its report charts the per-layer sensitivity. `start: smallest`:
the repair stage starts from the ladder's smallest rung (2-bit g128), not the recipe's 4 bits."""

import json

import yaml


def repair_recipe(draft_dir, tmp_path, **gate) -> tuple[dict, object]:
    """draft at RTN w4 g128 against a KLD it misses, repaired from the ladder's smallest rung; the
    recipe and its file."""
    recipe = {
        "model": str(draft_dir),
        "quantize": {"method": "rtn", "weights": {"bits": 4, "group_size": 128}},
        "gate": {
            **gate,
            "max_windows": 4,
            "max_kld": 0.006,
            "repair": {"max_evaluations": 3, "windows": 4, "start": "smallest"},
        },
        "output": str(tmp_path / "release"),
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return recipe, path


def test_run_repairs_what_the_gate_rejects(run_cli, tmp_path, draft_dir):
    from transformers import AutoModelForCausalLM

    recipe, path = repair_recipe(draft_dir, tmp_path)
    code, out, err = run_cli("run", path, "--json")
    assert code == 0, err
    assert [s["stage"] for s in json.loads(out)["stages"]] == ["quantize", "gate", "repair", "package"]
    release = tmp_path / "release"
    manifest = json.loads((release / "optkit.json").read_text())
    assert manifest["verdict"] == "released" and manifest["gate"]["metrics"]["kld_mean"] <= 0.006
    raised = manifest["precision_overrides"]
    assert raised and manifest["repair"]["steps"][0]["passed"] is False
    card = (release / "README.md").read_text()
    assert manifest["options"]["weights"]["bits"] == 2 and "2-bit, group size 128" in card  # the ladder's smallest rung
    assert "Layers kept at higher precision" in card
    assert all(f"`{name}`" in card for name in raised) and "of the KLD" in card
    assert "Per-layer sensitivity" in (release / "report.html").read_text()
    assert run_cli("verify", release)[0] == 0
    AutoModelForCausalLM.from_pretrained(release)

    bad = {**recipe, "gate": {**recipe["gate"], "repair": {"precisions": [4]}}}
    path.write_text(yaml.safe_dump(bad))
    code, _, err = run_cli("run", path)
    assert code == 2 and "gate.repair.precisions" in err


def test_the_release_verdict_comes_from_the_recipes_engine_after_repair(run_cli, tmp_path, draft_dir):
    """Repair searches with transformers; with `gate.engine: optkit` the artifact it chose is gated
    once more on optkit's runtime, and that gate (the numbers `optkit eval --engine optkit` gives) is
    the release's verdict."""
    _, path = repair_recipe(draft_dir, tmp_path, engine="optkit")
    code, out, err = run_cli("run", path, "--json")
    assert code in (0, 1), err
    gate = json.loads((tmp_path / "release" / "optkit.json").read_text())["gate"]
    assert gate["engine"]["name"] == "optkit" and gate["repair_engine"] == "transformers"
    code, out, err = run_cli(
        "eval", tmp_path / "release", "--baseline", draft_dir, "--engine", "optkit", "--max-windows", "4", "--json"
    )
    assert json.loads(out)["metrics"]["kld_mean"] == gate["metrics"]["kld_mean"]
