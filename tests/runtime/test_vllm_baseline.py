"""`optkit bench --baseline vllm` (runtime/vllm_baseline.py) against a fake vLLM worker: a python that
speaks the worker's protocol (optkit/engines/vllm.py) with known timings, so the rows, the ratios
and the settings each load asks for are checked without vLLM; a missing or dying worker is one line."""

import json
import sys
import textwrap

import pytest

FAKE_WORKER = """
import json, sys
log = open(sys.argv[1], "a")
print(json.dumps({"event": "hello", "protocol": 1, "vllm": "0.32.0", "torch": "2.13.0+cpu", "python": "3"}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    op = request["op"]
    log.write(line)
    log.flush()
    if op == "load" and REFUSE and not request["enforce_eager"]:
        print(json.dumps({"ok": False, "op": op, "error": "RuntimeError: Observed exception (compiling)"}), flush=True)
        continue
    if op == "load":
        eager = request["enforce_eager"]
    if op == "bench" and REFUSE == "all" and eager:  # loads eager, fails at its first request
        print(json.dumps({"ok": False, "op": op, "error": "AttributeError: no cpu_gemm_wna16"}), flush=True)
        continue
    if op == "load":
        if DIE_ON_LOAD:
            sys.stderr.write("RuntimeError: the engine core died\\n")
            sys.exit(3)
        reply = {"vocab_size": 4096, "dtype": request["dtype"], "quantization": None, "load_s": 1.5}
    elif op == "bench":
        n, tokens = len(request["prompts"]), request["max_tokens"]
        wall = 2.0 * n
        reply = {"wall_s": wall, "ttft_s": [0.1 * (i + 1) for i in range(n)], "tpot_s": [0.01] * n,
                 "output_tokens": [tokens] * n}
    else:
        reply = {}
    print(json.dumps({"ok": True, "op": op, **reply}), flush=True)
    if op == "shutdown":
        break
"""


def _fake_python(tmp_path, die_on_load: bool = False, refuse: str = ""):
    """An executable that, run as vLLM's python on the worker script, runs the fake worker instead;
    `refuse`: "compiled" (it refuses loads at vLLM's default settings) or "all" (eager it loads, then
    refuses the first request)."""
    script = tmp_path / "fake_worker.py"
    script.write_text(f"DIE_ON_LOAD = {die_on_load}\nREFUSE = {refuse!r}\n" + textwrap.dedent(FAKE_WORKER))
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "{tmp_path / "requests.jsonl"}"\n')
    python.chmod(0o755)
    return python, tmp_path / "requests.jsonl"


def test_bench_runs_vllm_at_its_defaults_and_eager_with_ratios(run_cli, draft_dir, tmp_path):
    from optkit.runtime.benchmark import percentiles

    python, requests = _fake_python(tmp_path)
    code, out, err = run_cli(
        "bench", draft_dir, "--baseline", "vllm", "--vllm-python", python, "--batch-sizes", "1,2",
        "--prompt-len", "8", "--gen-len", "4", "--device", "cpu", "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    rows = {(r["run"], r["batch_size"]): r for r in result["rows"]}
    for name in ("vLLM", "vLLM --enforce-eager"):
        for batch in (1, 2):
            row = rows[name, batch]
            assert row["tokens_per_s"] == pytest.approx(batch * 4 / (2.0 * batch))  # the worker's wall time
            assert row["ttft_s"] == percentiles([0.1 * (i + 1) for i in range(batch)])  # the worker's own times
            assert row["tpot_s"] == percentiles([0.01] * batch)
            optkit = rows["optkit", batch]
            assert optkit[f"vs {name}"] == pytest.approx(optkit["tokens_per_s"] / row["tokens_per_s"])
    assert [r["batch_size"] for r in result["rows"]] == sorted(r["batch_size"] for r in result["rows"])
    loads = {"vLLM": 1.5, "vLLM --enforce-eager": 1.5}
    assert result["vllm"] == {"version": "0.32.0", "dtype": "float32", "load_s": loads}
    sent = [json.loads(line) for line in requests.read_text().splitlines()]
    loads = [r for r in sent if r["op"] == "load"]
    assert [(r["enforce_eager"], r["dtype"], r["max_model_len"]) for r in loads] == [
        (False, "float32", 12),
        (True, "float32", 12),
    ]
    # each setting: one warm-up, then every batch size, all prompts of a batch in one request
    benches = [len(r["prompts"]) for r in sent if r["op"] == "bench"]
    assert benches == [2, 1, 2, 2, 1, 2]
    assert {len(p) for r in sent if r["op"] == "bench" for p in r["prompts"]} == {8}


def test_vllm_runs_weight_only_artifacts_in_bfloat16(draft_dir, draft_w2):
    from optkit.runtime.vllm_baseline import vllm_dtype_for

    assert vllm_dtype_for(draft_w2, "float32") == "bfloat16"  # cpu_gemm_wna16 has no float32
    assert vllm_dtype_for(draft_dir, "float32") == "float32"
    assert vllm_dtype_for(draft_dir, "bfloat16") == "bfloat16"


def test_bench_without_vllm_python_is_one_line_before_any_load(run_cli, monkeypatch, draft_dir):
    monkeypatch.delenv("OPTKIT_VLLM_PYTHON", raising=False)
    code, out, err = run_cli("bench", draft_dir, "--baseline", "vllm")
    assert code == 2 and "--vllm-python" in err and "make vllm" in err
    assert len(err.strip().splitlines()) == 1 and out == ""


def test_bench_with_a_worker_that_dies_is_one_line(run_cli, draft_dir, tmp_path):
    python, _ = _fake_python(tmp_path, die_on_load=True)
    code, _, err = run_cli(
        "bench", draft_dir, "--baseline", "vllm", "--vllm-python", python, "--batch-sizes", "1",
        "--prompt-len", "4", "--gen-len", "2", "--device", "cpu",
    )  # fmt: skip
    assert code == 2 and "the engine core died" in err, err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_a_setting_vllm_refuses_is_said_and_the_other_still_runs(run_cli, draft_dir, tmp_path):
    python, _ = _fake_python(tmp_path, refuse="compiled")
    args = ["bench", draft_dir, "--baseline", "vllm", "--vllm-python", python, "--batch-sizes", "1",
            "--prompt-len", "4", "--gen-len", "2", "--device", "cpu"]  # fmt: skip
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert {r["run"] for r in result["rows"]} == {"optkit", "vLLM --enforce-eager"}
    assert list(result["vllm"]["refused"]) == ["vLLM"]  # vLLM's words after the model's path
    assert result["vllm"]["refused"]["vLLM"].endswith(": RuntimeError: Observed exception (compiling)")
    assert list(result["vllm"]["load_s"]) == ["vLLM --enforce-eager"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    said = " ".join(out.split())
    assert "vLLM refused the model:" in said and "Observed exception (compiling)" in said


def test_vllm_refusing_every_setting_is_one_line(run_cli, draft_dir, tmp_path):
    python, _ = _fake_python(tmp_path, refuse="all")
    code, out, err = run_cli(
        "bench", draft_dir, "--baseline", "vllm", "--vllm-python", python, "--batch-sizes", "1",
        "--prompt-len", "4", "--gen-len", "2", "--device", "cpu",
    )  # fmt: skip
    assert code == 2 and "vLLM refused the model at every setting: AttributeError: no cpu_gemm_wna16" in err, err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1
