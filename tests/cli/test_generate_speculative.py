"""`optkit generate --speculative`: the same greedy tokens as without it; a bad value is one line."""

import json


def test_speculative_generate_equals_plain(run_cli, draft_dir):
    args = ("generate", draft_dir, "def main():\n    def main():", "--max-tokens", "16", "--json")
    _, plain, _ = run_cli(*args)
    for proposer in ("ngram", f"draft:{draft_dir}"):
        code, out, err = run_cli(*args, "--speculative", proposer, "--num-speculative-tokens", "3")
        assert code == 0, err
        assert json.loads(out)["token_ids"] == json.loads(plain)["token_ids"]


def test_bad_speculative_is_one_line(run_cli, draft_dir):
    code, _, err = run_cli("generate", draft_dir, "hi", "--speculative", "eagle")
    assert code == 2 and "unknown --speculative 'eagle'" in err and err.count("\n") == 1, err
    code, _, err = run_cli("generate", draft_dir, "hi", "--speculative", "draft:/nonexistent/model")
    assert code == 2 and err.count("\n") == 1, err
