import json
import subprocess
import sys

import pytest


def test_every_command_has_help_with_an_example(run_cli):
    for command in (
        ["quantize"],
        ["eval"],
        ["inspect"],
        ["verify"],
        ["generate"],
        ["serve"],
        ["zoo", "build"],
        ["zoo", "list"],
        ["speculator", "train"],
    ):
        code, out, _ = run_cli(*command, "--help")
        assert code == 0 and "Example: optkit" in out, command


def test_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "optkit.cli.main", "zoo", "list", "--json"], capture_output=True, text=True, check=True
    )
    names = {row["name"]: row["built"] for row in json.loads(result.stdout)}
    assert set(names) == {"small", "draft", "small-moe", "deep", "small-qwen3"}
    # committed; deep and small-qwen3 are built on demand
    assert names["small"] and names["draft"] and names["small-moe"]


def test_quantize_inspect_eval_round_trip(run_cli, tmp_path, draft_dir):
    artifact = tmp_path / "draft-w8"
    code, out, err = run_cli("quantize", draft_dir, "--bits", "8", "--out", artifact, "--json")
    assert code == 0, err
    assert json.loads(out)["options"]["weights"]["bits"] == 8

    code, out, _ = run_cli("inspect", artifact, "--json")
    assert code == 0 and json.loads(out)["method"] == "rtn"
    code, out, _ = run_cli("inspect", artifact)
    assert code == 0 and "model.layers.0.self_attn.q_proj" in out

    report = tmp_path / "gate.json"
    code, out, _ = run_cli(
        "eval", artifact, "--baseline", draft_dir, "--max-windows", "8", "--max-kld", "0.01", "--report", report
    )
    assert code == 0 and "PASS" in out
    assert json.loads(report.read_text())["verdict"] == "pass"


def test_crossed_threshold_exits_1_and_names_it(run_cli, draft_dir, draft_w2):
    artifact = draft_w2
    code, out, _ = run_cli(
        "eval",
        artifact,
        "--baseline",
        draft_dir,
        "--max-windows",
        "8",
        "--max-kld",
        "0.001",
        "--min-top1",
        "50",
        "--json",
    )
    result = json.loads(out)
    assert code == 1 and result["verdict"] == "fail"
    assert [c["name"] for c in result["checks"] if not c["passed"]][0] == "max_kld"


@pytest.mark.slow
def test_gate_separates_8_bit_from_2_bit_on_small(run_cli, tmp_path, small_dir):
    """Acceptance: on `small`, RTN 8-bit passes --max-ppl-increase 0.5 --max-kld 0.005 and
    RTN 2-bit fails --max-ppl-increase 5."""
    for bits in (8, 2):
        assert run_cli("quantize", small_dir, "--bits", str(bits), "--out", tmp_path / f"w{bits}")[0] == 0
    code, out, _ = run_cli(
        "eval", tmp_path / "w8", "--baseline", small_dir, "--max-ppl-increase", "0.5", "--max-kld", "0.005", "--json"
    )
    assert code == 0, out
    code, out, _ = run_cli("eval", tmp_path / "w2", "--baseline", small_dir, "--max-ppl-increase", "5", "--json")
    assert code == 1 and json.loads(out)["metrics"]["ppl_increase_pct"] > 5


def test_verify_accepts_an_artifact_and_names_a_changed_file(run_cli, tmp_path, draft_dir):
    artifact = tmp_path / "q"
    assert run_cli("quantize", draft_dir, "--out", artifact)[0] == 0
    code, out, _ = run_cli("verify", artifact)
    assert code == 0 and "match optkit.json" in out
    weights = artifact / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one byte of tensor data
    weights.write_bytes(bytes(data))
    code, out, _ = run_cli("verify", artifact, "--json")
    assert code == 1
    assert json.loads(out)["problems"] == ["model.safetensors: sha256 differs from optkit.json"]
    (artifact / "extra.bin").write_bytes(b"x")
    code, out, _ = run_cli("verify", artifact)
    assert code == 1 and "extra.bin: not listed" in out
