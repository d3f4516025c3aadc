"""`optkit quantize --target-kld`: exit 0 with the repaired artifact at --out; exit 1 with one line
when the budget cannot reach the target, the closest artifact beside --out as NAME.rejected."""

import json

from optkit.manifest import read_manifest


def test_budget_exhaustion_exits_1_and_writes_the_closest_beside_the_output(run_cli, tmp_path):
    out = tmp_path / "draft-w4"
    code, _, err = run_cli(
        "quantize", "draft", "--out", out, "--target-kld", "1e-6", "--max-size-mb", "1.3", "--gate-windows", "2"
    )
    assert code == 1
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "size budget (1.3 MB) is spent" in lines[0], err
    assert not out.exists()  # never at the release path
    rejected = tmp_path / "draft-w4.rejected"
    manifest = read_manifest(rejected)
    assert manifest["repair"]["result"].startswith("failed: the size budget")
    steps = manifest["repair"]["steps"]
    assert len(steps) >= 2 and all(s["size_mb"] <= 1.3 for s in steps)
    assert manifest["gate"]["verdict"] == "fail"
    assert (rejected / "model.safetensors").stat().st_size <= 1.3 * 2**20
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no work directory left


def test_a_format_without_per_layer_precision_is_refused_before_quantizing(run_cli, tmp_path):
    code, _, err = run_cli("quantize", "draft", "--out", tmp_path / "a", "--format", "awq", "--target-kld", "0.01")
    assert code == 2 and "--format awq has no per-layer precision" in err
    assert not (tmp_path / "a").exists()


def test_a_target_the_uniform_artifact_meets_is_released_as_it_is(run_cli, tmp_path):
    out = tmp_path / "w8"
    code, _, _ = run_cli(
        "quantize", "draft", "--bits", "8", "--out", out, "--target-kld", "0.01", "--gate-windows", "2"
    )
    assert code == 0
    manifest = read_manifest(out)
    assert manifest["repair"]["result"] == "passed without repair"
    assert "precision_overrides" not in manifest
    assert json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].keys() == {"group_0"}


def test_eval_attribute_ranks_layers_in_json_and_in_a_table(run_cli, tmp_path):
    out = tmp_path / "w4"
    assert run_cli("quantize", "draft", "--out", out)[0] == 0
    args = ("eval", out, "--baseline", "draft", "--max-windows", "2", "--attribute", "--attribute-windows", "2")
    code, printed, _ = run_cli(*args, "--json")
    assert code == 0
    attribution = json.loads(printed)["attribution"]
    estimates = [layer["estimate"] for layer in attribution["layers"]]
    assert len(estimates) == 14 and estimates == sorted(estimates, reverse=True) and estimates[0] > 0
    assert attribution["exact_swaps"] == 3 and attribution["source"].startswith("calib")
    code, printed, _ = run_cli(*args)
    assert code == 0 and "per-layer sensitivity" in printed and attribution["layers"][0]["name"] in printed


def test_repair_start_smallest_raises_2_bit_layers_along_the_ladder(run_cli, tmp_path):
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    code, _, err = run_cli("quantize", "draft", "--out", tmp_path / "x", "--target-kld", "1", "--repair-start", "big")
    assert code == 2 and "--repair-start 'big' is invalid" in err
    out = tmp_path / "smallest"
    args = ("--target-kld", "0.006", "--repair-start", "smallest", "--gate-windows", "4", "--max-evaluations", "3")
    code, _, err = run_cli("quantize", "draft", "--out", out, *args)
    assert code == 0, err
    manifest = read_manifest(out)
    weights = manifest["options"]["weights"]  # the start: the ladder's smallest rung, 2-bit g128
    assert (weights["bits"], weights["group_size"]) == (2, 128)
    assert manifest["gate"]["verdict"] == "pass" and manifest["gate"]["metrics"]["kld_mean"] <= 0.006
    overrides = manifest["precision_overrides"]
    assert any(rung["bits"] in (3, 4) for rung in overrides.values())  # 2 -> 3 or 4 bits: not only 8 and 16
    steps = manifest["repair"]["steps"]
    assert steps[0]["passed"] is False and all(s["changed"] and s["size_mb"] > steps[0]["size_mb"] for s in steps[1:])
    quantize_model("draft", tmp_path / "w8", QuantizeOptions(weights=WeightScheme(bits=8, group_size=128)))
    assert (out / "model.safetensors").stat().st_size < (tmp_path / "w8" / "model.safetensors").stat().st_size
