import json

import pytest
import torch

from optkit.data.corpus import stdlib_files
from optkit.data.eval_sets import bundled_names, load_definition, load_text_set, materialize
from optkit.data.packing import pack_windows, tokenize_stream, tokenize_stream_prefix
from optkit.errors import OptkitError


def test_bundled_sets_are_defined():
    assert {"heldout", "calib", "distill", "next_line"} <= set(bundled_names())


def test_materialising_is_deterministic(tmp_path, monkeypatch):
    first = load_text_set("heldout")
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path))  # build again from scratch elsewhere
    second = load_text_set("heldout")
    assert second.path != first.path and second.sha256 == first.sha256


def test_heldout_text_never_comes_from_training_files():
    train = {p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files("train")}
    heldout = [json.loads(line) for line in materialize("heldout").read_text().splitlines()]
    for training_set in ("calib", "distill"):
        records = [json.loads(line) for line in materialize(training_set).read_text().splitlines()]
        assert {r["source"] for r in heldout}.isdisjoint({r["source"] for r in records})
    assert not any(r["text"] in train for r in heldout if len(r["text"]) > 200)
    assert sum(len(r["text"]) for r in heldout) <= load_definition("heldout").max_chars


def test_multiple_choice_task_is_well_formed():
    records = [json.loads(line) for line in materialize("next_line").read_text().splitlines()]
    definition = load_definition("next_line")
    assert len(records) == definition.num_questions
    for r in records:
        assert len(r["choices"]) == definition.num_choices == len(set(r["choices"]))
        assert 0 <= r["gold"] < definition.num_choices
        assert r["context"].count("\n") == definition.context_lines
    golds = [r["gold"] for r in records]
    assert len(set(golds)) == definition.num_choices  # the answer is not always in one place


def test_task_is_not_a_text_set():
    with pytest.raises(OptkitError, match="is a task, not text"):
        load_text_set("next_line")


def test_user_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello\nworld\n")
    assert load_text_set(str(tmp_path / "a.txt")).texts == ["hello\nworld\n"]
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert load_text_set(str(tmp_path / "b.jsonl")).texts == ["one", "two"]
    with pytest.raises(OptkitError, match="unsupported file type"):
        (tmp_path / "c.csv").write_text("x")
        load_text_set(str(tmp_path / "c.csv"))


def test_datasets_formats(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["alpha", "beta"]})
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert load_text_set(str(tmp_path / "saved")).texts == ["alpha", "beta"]
    assert load_text_set(str(tmp_path / "d.parquet")).texts == ["alpha", "beta"]
    datasets.Dataset.from_dict({"body": ["x"]}).to_parquet(str(tmp_path / "e.parquet"))
    with pytest.raises(OptkitError, match="needs a 'text' column"):
        load_text_set(str(tmp_path / "e.parquet"))


def test_packing_joins_texts_with_eos_and_cuts_windows(draft_dir):
    from optkit.modeldir import load_tokenizer

    tokenizer = load_tokenizer(draft_dir)
    stream = tokenize_stream(tokenizer, ["def f():", "return 1"])
    assert (stream == tokenizer.eos_token_id).sum() == 2 and stream[-1] == tokenizer.eos_token_id
    windows = pack_windows(stream, 3)
    assert windows.shape == (stream.numel() // 3, 3)
    assert pack_windows(stream, 3, max_windows=1).shape == (1, 3)


def test_a_stream_prefix_is_the_streams_first_texts_holding_the_tokens_asked_for(draft_dir):
    from optkit.modeldir import load_tokenizer

    tokenizer = load_tokenizer(draft_dir)
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(100)]
    whole = tokenize_stream(tokenizer, texts)
    assert torch.equal(tokenize_stream_prefix(tokenizer, texts, whole.numel() + 1), whole)
    prefix = tokenize_stream_prefix(tokenizer, texts, 10)
    assert 10 <= prefix.numel() < whole.numel() and torch.equal(prefix, whole[: prefix.numel()])
    assert prefix[-1] == tokenizer.eos_token_id  # whole texts only
