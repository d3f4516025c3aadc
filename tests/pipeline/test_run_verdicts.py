"""`optkit run` never releases on a gate that was asked nothing, and an inconclusive gate is
neither a release nor a rejection (exit 4)."""

import json

import yaml

from optkit.pipeline.recipe import load_recipe


def write(tmp_path, draft_dir, gate: dict) -> str:
    recipe = {
        "model": str(draft_dir),
        "quantize": {"method": "rtn", "weights": {"bits": 4, "group_size": 64}},
        "gate": gate,
        "output": str(tmp_path / "release"),
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_a_recipe_without_a_threshold_is_refused_before_any_work(run_cli, tmp_path, draft_dir):
    code, out, err = run_cli("run", write(tmp_path, draft_dir, {"max_windows": 4}))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "gate.max_kld" in err and "no threshold" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]  # no release, no work directory


def test_every_bundled_recipe_sets_a_threshold():
    from pathlib import Path

    recipes = sorted(Path(__file__).parents[2].joinpath("recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        if ".template." in path.name:
            continue  # a model path to fill in; its gate is checked all the same below
        assert load_recipe(path, [])[0].gate.any_set(), path
    for path in recipes:
        gate = yaml.safe_load(path.read_text())["gate"]
        assert any(k in gate for k in ("max_kld", "max_ppl_increase", "min_top1", "min_recovery")), path


def test_an_inconclusive_gate_marks_the_release_inconclusive_and_exits_4(run_cli, tmp_path, draft_dir):
    # 8 windows: `confident` never passes below 10, and no KLD is provably above 10 nats
    recipe = write(tmp_path, draft_dir, {"max_windows": 8, "max_kld": 10.0, "decision": "confident"})
    code, out, err = run_cli("run", recipe, "--json")
    assert code == 4, err
    result = json.loads(out)
    assert result["verdict"] == "inconclusive" and result["gate"]["verdict"] == "inconclusive"
    release = tmp_path / "release"
    manifest = json.loads((release / "optkit.json").read_text())
    assert manifest["verdict"] == "inconclusive" and manifest["gate"]["decision"]["rule"] == "confident"
    assert "INCONCLUSIVE" in (release / "README.md").read_text()
    # the same recipe under the point rule: today's verdict
    code, out, _ = run_cli("run", recipe, "--set", "gate.decision=point", "--json")
    assert code == 0 and json.loads(out)["verdict"] == "released"


def test_a_threshold_outside_its_metrics_range_is_one_line_before_any_work(run_cli, tmp_path, draft_dir):
    """A recipe is someone else's file: -100% perplexity once reached log1p(-1) in --sequential (exit 3)."""
    for gate, key in (
        ({"max_ppl_increase": -100, "sequential": True}, "max_ppl_increase"),
        ({"max_kld": -0.01}, "max_kld"),
        ({"min_top1": 101}, "min_top1"),
        ({"max_kld": float("nan")}, "max_kld"),
    ):
        code, out, err = run_cli("run", write(tmp_path, draft_dir, gate))
        assert code == 2 and len(err.strip().splitlines()) == 1 and key in err, (gate, err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]
