"""`optkit speculator train`: deterministic with a seed, resumable exactly, and a head refused for
another target."""

import json

import pytest
from safetensors.torch import load_file

from optkit.errors import OptkitError
from optkit.quant.formats.load import load_model
from optkit.speculative.head_files import read_head
from optkit.speculative.options import SpeculatorTrainOptions
from optkit.speculative.train import train_speculator

TINY = dict(
    steps=4, batch_size=2, seq_len=32, warmup_steps=1, eval_prompts=1, eval_new_tokens=8, num_speculative_tokens=2
)


def tensors(head_dir):
    return load_file(str(head_dir / "model.safetensors"))


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].equal(b[name]), name


def test_training_is_deterministic_with_a_seed_and_differs_with_another(tmp_path, draft_dir):
    options = SpeculatorTrainOptions(**TINY)
    first = train_speculator(draft_dir, tmp_path / "a", options)
    train_speculator(draft_dir, tmp_path / "b", options)
    train_speculator(draft_dir, tmp_path / "c", options.model_copy(update={"seed": 1}))
    assert_same_tensors(tensors(tmp_path / "a"), tensors(tmp_path / "b"))
    assert not tensors(tmp_path / "a")["fc.weight"].equal(tensors(tmp_path / "c")["fc.weight"])
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["format"] == "optkit-eagle" and config["model_type"] == "llama"
    assert set(tensors(tmp_path / "a")) >= {"fc.weight", "layers.0.self_attn.q_proj.weight"}
    assert "layers.0.input_layernorm.weight" not in tensors(tmp_path / "a")
    assert first.steps == 4 and 1.0 <= first.mean_acceptance_length <= 3.0
    assert not (tmp_path / "a.checkpoint").exists()  # removed once the head is written


def test_an_interrupted_training_resumed_equals_an_uninterrupted_one(tmp_path, draft_dir):
    options = SpeculatorTrainOptions(**TINY, checkpoint_every=1)
    train_speculator(draft_dir, tmp_path / "whole", options)
    assert train_speculator(draft_dir, tmp_path / "resumed", options, stop_after=3) is None
    assert not (tmp_path / "resumed").exists() and (tmp_path / "resumed.checkpoint" / "state.json").exists()
    train_speculator(draft_dir, tmp_path / "resumed", options, resume=True)
    assert_same_tensors(tensors(tmp_path / "whole"), tensors(tmp_path / "resumed"))


def test_resume_refuses_a_checkpoint_written_with_other_options(tmp_path, draft_dir):
    options = SpeculatorTrainOptions(**TINY)
    train_speculator(draft_dir, tmp_path / "h", options, stop_after=1)
    with pytest.raises(OptkitError, match="learning_rate"):
        train_speculator(draft_dir, tmp_path / "h", options.model_copy(update={"learning_rate": 1e-4}), resume=True)


def test_a_head_is_refused_for_another_target(tmp_path, draft_dir, small_dir):
    train_speculator(draft_dir, tmp_path / "h", SpeculatorTrainOptions(**TINY))
    read_head(tmp_path / "h", load_model(draft_dir), draft_dir)  # its own target: fine
    with pytest.raises(OptkitError, match="trained for another model"):
        read_head(tmp_path / "h", load_model(small_dir), small_dir)


def test_the_command_writes_a_head_and_reports_its_acceptance(tmp_path, draft_dir, run_cli):
    code, out, err = run_cli(
        "speculator", "train", draft_dir, "--out", tmp_path / "h", "--steps", "2", "--batch-size", "2",
        "--seq-len", "32", "--num-speculative-tokens", "2", "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert report["steps"] == 2 and report["num_speculative_tokens"] == 2 and report["mean_acceptance_length"] >= 1
    code, _, err = run_cli("speculator", "train", draft_dir, "--out", tmp_path / "h", "--steps", "2")
    assert code == 2 and "already exists" in err and len(err.strip().splitlines()) == 1
