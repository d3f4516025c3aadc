import math

import torch

from optkit.data.corpus import split_of, stdlib_files
from optkit.zoo.specs import SPECS
from optkit.zoo.tokenizer import train_tokenizer


def test_split_is_by_file_and_stable():
    train, heldout = stdlib_files("train"), stdlib_files("heldout")
    assert train and heldout and set(train).isdisjoint(heldout)
    assert 0.03 < len(heldout) / (len(train) + len(heldout)) < 0.15
    assert split_of("json/decoder.py") == split_of("json/decoder.py")
    assert not any("test" in p.parts for p in train + heldout)


def test_tokenizer_training_is_deterministic_and_round_trips():
    texts = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 20
    first, second = train_tokenizer(texts, 300), train_tokenizer(texts, 300)
    assert first.get_vocab() == second.get_vocab()
    assert first.decode(first("    return a + b")["input_ids"]) == "    return a + b"


def test_reference_specs_have_the_promised_sizes(draft_dir, small_dir):
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    small = AutoModelForCausalLM.from_pretrained(small_dir)
    assert 0.5e6 < draft.num_parameters() < 1.5e6
    assert 4e6 < small.num_parameters() < 8e6
    assert small.config.num_key_value_heads < small.config.num_attention_heads  # grouped-query attention
    assert draft.config.vocab_size == small.config.vocab_size


def test_bundled_models_share_one_tokenizer(draft_dir, small_dir):
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(draft_dir).get_vocab() == AutoTokenizer.from_pretrained(small_dir).get_vocab()


def test_short_build_through_the_cli(run_cli, tmp_path):
    """`optkit zoo build` end to end, with a few steps of training instead of the full recipe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "draft"
    code, stdout, stderr = run_cli("zoo", "build", "draft", "--out", out, "--steps", "4", "--json")
    assert code == 0, stderr
    import json

    report = json.loads(stdout)
    assert report["steps"] == 4 and math.isfinite(report["heldout_perplexity"])
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.hidden_size == SPECS["draft"].hidden_size
    assert next(model.parameters()).dtype == torch.bfloat16
    assert len(tokenizer) == model.config.vocab_size
    assert list(out.glob("*.safetensors")) and not list(out.glob("*.bin"))
