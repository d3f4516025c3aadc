import json

import pytest
import yaml

from tests.cli.test_bad_input import assert_user_error


def write_recipe(tmp_path, draft_dir, **changes) -> str:
    recipe = {
        "model": str(draft_dir),
        "quantize": {
            "method": "gptq",
            "weights": {"bits": 4, "group_size": 64, "symmetric": True},
            "calibration": {"num_samples": 8, "seq_len": 64},
        },
        "gate": {"max_windows": 8, "max_kld": 0.05},
        "output": str(tmp_path / "release"),
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            recipe[section][field] = value
        else:
            recipe[section] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def stage_status(result) -> dict[str, str]:
    return {s["stage"]: s["status"] for s in json.loads(result[1])["stages"]}


def test_run_releases_verifies_loads_and_skips_unchanged_stages(run_cli, tmp_path, draft_dir):
    from transformers import AutoModelForCausalLM

    recipe = write_recipe(tmp_path, draft_dir)
    first = run_cli("run", recipe, "--json")
    assert first[0] == 0, first[2]
    assert stage_status(first) == {"quantize": "ran", "gate": "ran", "package": "ran"}
    release = tmp_path / "release"
    manifest = json.loads((release / "optkit.json").read_text())
    assert manifest["verdict"] == "released" and manifest["recipe"]["quantize"]["method"] == "gptq"
    assert manifest["gate"]["verdict"] == "pass" and "README.md" in manifest["files"]
    assert "RELEASED" in (release / "README.md").read_text()
    assert run_cli("verify", release)[0] == 0
    AutoModelForCausalLM.from_pretrained(release)

    second = run_cli("run", recipe, "--json")
    assert second[0] == 0 and stage_status(second) == {"quantize": "skipped", "gate": "skipped", "package": "ran"}
    assert json.loads((release / "optkit.json").read_text())["files"] == manifest["files"]

    third = run_cli("run", recipe, "--set", "gate.max_kld=0.04", "--json")  # only the gate changed
    assert stage_status(third) == {"quantize": "skipped", "gate": "ran", "package": "ran"}


def test_thresholds_the_artifact_cannot_meet_reject_the_release(run_cli, tmp_path, draft_dir):
    recipe = write_recipe(tmp_path, draft_dir, gate__min_top1=100.0)
    code, out, _ = run_cli("run", recipe, "--json")
    assert code == 1 and json.loads(out)["verdict"] == "rejected"
    release = tmp_path / "release"
    manifest = json.loads((release / "optkit.json").read_text())
    assert manifest["verdict"] == "rejected"
    assert json.loads((release / "gate.json").read_text())["verdict"] == "fail"
    assert "REJECTED" in (release / "README.md").read_text()


def test_a_compile_section_warms_this_machine_and_ships_no_cache(run_cli, tmp_path, draft_dir, monkeypatch):
    """The compile stage warms the local compile cache, where `serve` and `generate` find the
    release (it shares the artifact's content id); the release carries no compile/, only a record
    of the warm-up in optkit.json. An unchanged rerun skips the warm-up, new batch sizes redo it."""
    from optkit.runtime.compile_cache import cache_path
    from optkit.runtime.engine import EngineConfig, LLMEngine

    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    recipe = write_recipe(tmp_path, draft_dir, compile={"batch_sizes": [1, 4], "device": "cpu"})
    first = run_cli("run", recipe, "--json")
    assert first[0] == 0, first[2]
    assert stage_status(first) == {"quantize": "ran", "gate": "ran", "compile": "ran", "package": "ran"}
    release = tmp_path / "release"
    assert not (release / "compile").exists()
    manifest = json.loads((release / "optkit.json").read_text())
    assert not any(name.startswith("compile") for name in manifest["files"])
    assert manifest["compile"]["batch_sizes"] == [1, 4] and manifest["compile"]["device"] == "cpu"
    warmed = json.loads((cache_path(release, "cpu") / "compile.json").read_text())
    assert warmed == manifest["compile"]  # what was warmed, as plain data
    assert f"compile cache {cache_path(release, 'cpu')}" in LLMEngine(release, EngineConfig()).cuda_graphs_note
    assert run_cli("verify", release)[0] == 0

    second = run_cli("run", recipe, "--json")
    assert stage_status(second)["compile"] == "skipped"
    third = run_cli("run", recipe, "--set", "compile.batch_sizes=[2]", "--json")
    assert stage_status(third) == {"quantize": "skipped", "gate": "skipped", "compile": "ran", "package": "ran"}
    assert json.loads((release / "optkit.json").read_text())["compile"]["batch_sizes"] == [2]
    assert json.loads((cache_path(release, "cpu") / "compile.json").read_text())["batch_sizes"] == [2]


def test_a_rejected_artifact_is_not_compiled(run_cli, tmp_path, draft_dir):
    recipe = write_recipe(tmp_path, draft_dir, gate__min_top1=100.0, compile={"batch_sizes": [1], "device": "cpu"})
    code, out, _ = run_cli("run", recipe, "--json")
    assert code == 1 and stage_status((code, out))["compile"] == "skipped (rejected)"
    assert not (tmp_path / "release" / "compile").exists()


@pytest.mark.parametrize(
    "changes,fragments",
    [
        ({"quantize__gptq": {"act_ordr": True}}, ("quantize.gptq.act_ordr", "did you mean 'act_order'")),
        ({"gate__max_kdl": 0.1}, ("gate.max_kdl", "did you mean 'max_kld'")),
        ({"quantize__weights": {"bits": "four"}}, ("quantize.weights.bits", "valid integer")),
        ({"quantize__method": "smoothquant"}, ("int8 per output channel",)),
        ({"compile": {"batch_size": [1]}}, ("compile.batch_size", "did you mean 'batch_sizes'")),
        ({"compile": {"batch_sizes": [0, 8]}}, ("compile", "at least 1")),
    ],
)
def test_bad_recipes_name_the_key(run_cli, tmp_path, draft_dir, changes, fragments):
    assert_user_error(run_cli("run", write_recipe(tmp_path, draft_dir, **changes)), *fragments)
    assert not (tmp_path / "release").exists()


def test_missing_model_and_missing_recipe(run_cli, tmp_path, draft_dir):
    assert_user_error(run_cli("run", write_recipe(tmp_path, draft_dir, model=str(tmp_path / "nope"))), "does not exist")
    assert_user_error(run_cli("run", tmp_path / "none.yaml"), "recipe", "does not exist")
    assert_user_error(run_cli("run", write_recipe(tmp_path, draft_dir), "--set", "gate"), "key.path=value")


def test_a_killed_run_resumes_to_the_same_artifact(tmp_path, draft_dir):
    """kill -9 during quantization, rerun: the same files, hash for hash, as an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    recipe = write_recipe(tmp_path, draft_dir, quantize__calibration={"num_samples": 64, "seq_len": 128})
    command = [sys.executable, "-m", "optkit.cli.main", "run", recipe, "--json"]
    work = tmp_path / ".release.work"

    def quantized_files() -> dict:
        return json.loads((work / "quantized" / "optkit.json").read_text())["files"]

    assert subprocess.run(command, capture_output=True).returncode == 0
    expected = quantized_files()
    for path in (work, tmp_path / "release"):
        subprocess.run(["rm", "-rf", str(path)], check=True)

    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (work.exists() and any(work.glob(".quantized.tmp-*"))) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # calibrating now
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not (work / "quantized").exists()  # killed inside the quantize stage

    rerun = subprocess.run(command, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert {s["stage"]: s["status"] for s in json.loads(rerun.stdout)["stages"]}["quantize"] == "ran"
    assert quantized_files() == expected
    assert not list(work.glob(".quantized.tmp-*"))


def test_gate_only_rerun_with_the_reference_cache_does_not_load_the_base(run_cli, tmp_path, draft_dir, monkeypatch):
    from optkit.gate import evaluate as evaluate_module

    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    gate = {"max_windows": 8, "max_kld": 0.05, "reference_cache": True, "task": "next_line", "min_recovery": 0.5}
    recipe = write_recipe(tmp_path, draft_dir, gate=gate)
    assert run_cli("run", recipe)[0] == 0
    loaded = []
    real_load = evaluate_module.load_model
    monkeypatch.setattr(evaluate_module, "load_model", lambda path, *a, **k: loaded.append(path) or real_load(path))
    result = run_cli("run", recipe, "--set", "gate.max_kld=0.04", "--json")
    assert stage_status(result) == {"quantize": "skipped", "gate": "ran", "package": "ran"}
    assert [p.name for p in loaded] == ["quantized"]  # the artifact only, never the base


@pytest.mark.parametrize(
    "stages,fragment",
    [
        (["gptq", "smoothquant"], "stage 2 'smoothquant' cannot follow the weight-only stage 'gptq'"),
        (["awq", "gptq"], "both quantize the weights"),
        (["smoothquant", "awq"], "cannot follow 'smoothquant'"),
        (["smoothqant"], "stage 1 'smoothqant' is unknown"),
    ],
)
def test_stage_orders_that_cannot_work_name_the_stage(run_cli, tmp_path, draft_dir, stages, fragment):
    recipe = write_recipe(tmp_path, draft_dir, stages=stages, quantize={"calibration": {"num_samples": 8}})
    assert_user_error(run_cli("run", recipe), fragment)


def test_stages_compose_smoothquant_then_gptq(tmp_path, draft_dir):
    from optkit.pipeline.recipe import load_recipe

    recipe, _ = load_recipe(write_recipe(tmp_path, draft_dir, stages=["smoothquant", "gptq"], quantize={}))
    assert recipe.quantize.method == "smoothquant+gptq" and recipe.quantize.weights.bits == 8
