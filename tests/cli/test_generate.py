"""`optkit generate`: one prompt, a batch from a file, streaming, and bad input."""

import json

from optkit.runtime.engine import LLMEngine
from optkit.runtime.sequence import SamplingParams


def test_one_prompt_json_matches_the_engine(run_cli, draft_dir):
    code, out, err = run_cli("generate", draft_dir, "def main():", "--max-tokens", "12", "--json")
    assert code == 0, err
    result = json.loads(out)
    engine = LLMEngine(draft_dir)
    expected = engine.generate([engine.tokenizer.encode("def main():")], SamplingParams(max_tokens=12, temperature=0))
    assert result["token_ids"] == expected[0]
    assert result["text"] == engine.tokenizer.decode(expected[0], skip_special_tokens=True)


def test_prompts_file_runs_each_with_its_own_settings(run_cli, tmp_path, draft_dir):
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "import os\n", "max_tokens": 3},
        {"prompt": "class A:", "max_tokens": 7, "temperature": 0.8, "seed": 1},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines))
    code, out, err = run_cli("generate", draft_dir, "--prompts", prompts, "--json")
    assert code == 0, err
    results = json.loads(out)
    assert [len(r["token_ids"]) for r in results] == [3, 7]
    code, again, _ = run_cli("generate", draft_dir, "--prompts", prompts, "--json")
    assert json.loads(again) == results  # seeded sampling is reproducible


def test_stream_prints_the_text(run_cli, draft_dir):
    code, out, _ = run_cli("generate", draft_dir, "def main():", "--max-tokens", "8", "--stream")
    _, batch, _ = run_cli("generate", draft_dir, "def main():", "--max-tokens", "8", "--json")
    assert code == 0 and out == json.loads(batch)["text"] + "\n"


def test_bad_input_is_one_line_and_exit_2(run_cli, tmp_path, draft_dir):
    bad = tmp_path / "bad.jsonl"
    cases = {
        "give one prompt": ("generate", draft_dir),
        "no such file": ("generate", draft_dir, "--prompts", tmp_path / "missing.jsonl"),
        "max_tokens must be at least 1": ("generate", draft_dir, "hi", "--max-tokens", "0"),
        "over the context limit": ("generate", draft_dir, "hi", "--max-tokens", "100000"),
    }
    for message, args in cases.items():
        code, _, err = run_cli(*args)
        assert code == 2 and message in err and err.count("\n") == 1, (message, err)
    for content, message in (
        ("{not json", "not JSON"),
        ('{"text": "x"}', '"prompt" string'),
        ('{"prompt": "x", "tokens": 1}', "unknown key 'tokens'"),
    ):
        bad.write_text(content)
        code, _, err = run_cli("generate", draft_dir, "--prompts", bad)
        assert code == 2 and message in err, (message, err)
