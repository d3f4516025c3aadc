"""`optkit bench --speculative`: the engine speculates against itself without speculation, in one run,
and reports the mean acceptance length (accepted tokens + 1 per verification step)."""

import json

from tests.runtime.eagle_heads import random_head


def test_bench_speculates_against_no_speculation_and_reports_acceptance(run_cli, tmp_path, draft_dir):
    head = random_head(draft_dir, tmp_path / "head")
    code, out, err = run_cli(
        "bench", draft_dir, "--batch-sizes", "1,2", "--prompt-len", "8", "--gen-len", "6", "--device", "cpu",
        "--speculative", f"eagle:{head}", "--num-speculative-tokens", "3", "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    assert (result["speculative"], result["num_speculative_tokens"]) == (f"eagle:{head}", 3)
    rows = {(r["run"], r["batch_size"]): r for r in result["rows"]}
    assert set(rows) == {(run, b) for run in ("optkit", "optkit, no speculation") for b in (1, 2)}
    for b in (1, 2):
        spec = rows["optkit", b]
        assert 1 <= spec["mean_acceptance_length"] <= 4 and 0 <= spec["acceptance_rate"] <= 1
        assert spec["vs optkit, no speculation"] > 0
        assert "mean_acceptance_length" not in rows["optkit, no speculation", b]

    code, out, err = run_cli("bench", draft_dir, "--batch-sizes", "1", "--prompt-len", "4", "--gen-len", "3",
                             "--speculative", "ngram")  # fmt: skip
    assert code == 0, err
    assert "accept len" in out and "--speculative ngram k=4" in out
