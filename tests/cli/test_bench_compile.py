"""`optkit bench` on CPU, with tiny settings (`optkit compile`: tests/runtime/test_compile_cache.py)."""

import json


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
    code, _, err = run_cli("bench", draft_dir, "--baseline", "vllx")
    assert code == 2 and "--baseline" in err and "vllm" in err  # the error lists the baselines
