"""`optkit bench` and `optkit compile` on CPU, with tiny settings."""

import json

from optkit.runtime.engine import EngineConfig, LLMEngine
from optkit.runtime.sequence import SamplingParams


def test_bench_json_has_engine_and_hf_rows_with_ratios(run_cli, draft_dir):
    code, out, err = run_cli(
        "bench", draft_dir, "--baseline", "hf", "--batch-sizes", "1,2", "--prompt-len", "8", "--gen-len", "4",
        "--device", "cpu", "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    rows = {(r["run"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {("optkit", 1), ("optkit", 2), ("transformers", 1), ("transformers", 2)}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and set(row["ttft_s"]) == {"p50", "p95", "p99"}
    assert rows["optkit", 2]["vs transformers"] > 0
    assert "CUDA graphs off" in result["cuda_graphs"] and "ceiling" not in result


def test_bench_table_and_bad_batch_sizes(run_cli, draft_dir):
    code, out, err = run_cli("bench", draft_dir, "--batch-sizes", "2", "--prompt-len", "4", "--gen-len", "2")
    assert code == 0, err
    assert "tok/s" in out
    code, _, err = run_cli("bench", draft_dir, "--batch-sizes", "1,x")
    assert code == 2 and "--batch-sizes" in err
    code, _, err = run_cli("bench", draft_dir, "--baseline", "vllm")
    assert code == 2 and "--baseline" in err


def test_compile_writes_the_manifest_and_the_engine_loads_it(run_cli, tmp_path, draft_dir):
    code, out, err = run_cli(
        "compile", draft_dir, "--batch-sizes", "1,2", "--out", tmp_path, "--device", "cpu", "--json"
    )  # fmt: skip
    assert code == 0, err
    manifest = json.loads((tmp_path / "compile" / "compile.json").read_text())
    assert manifest["batch_sizes"] == [1, 2] and manifest["torch_compile"] is False
    assert manifest["cuda_graphs"] is None and manifest["device_name"] == "cpu"
    assert json.loads(out)["key"] == manifest["key"]
    engine = LLMEngine(draft_dir, EngineConfig(compile_dir=str(tmp_path)))
    assert "compile cache" in engine.cuda_graphs_note
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0]) == 3


def test_torch_compile_needs_cuda(run_cli, tmp_path, draft_dir):
    code, _, err = run_cli("compile", draft_dir, "--out", tmp_path, "--device", "cpu", "--torch-compile")
    assert code == 2 and "--device cuda" in err
