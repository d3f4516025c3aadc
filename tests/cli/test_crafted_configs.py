"""A crafted config.json (issue 30, section 5) through every command that reads one: one error line
naming the key, exit 2, no traceback, nothing written; and before anything is allocated (a
head_dim of 2^32 once tried 16 GiB)."""

import json
import resource
import shutil
import subprocess
import sys

import pytest

from optkit.artifacts import file_sha256
from tests.cli.test_bad_input import assert_user_error
from tests.conftest import leftovers

# case -> (how config.json changes, what the error line names)
CRAFTED = {
    "zero heads": (lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads"),
    "a negative size": (lambda c: {**c, "intermediate_size": -5}, "intermediate_size"),
    "heads as a string": (lambda c: {**c, "num_attention_heads": "4"}, "num_attention_heads"),
    "the config as a list": (lambda c: [c], "not an object"),
    "eos as a string": (lambda c: {**c, "eos_token_id": "0"}, "eos_token_id"),
    "hidden size 0": (lambda c: {**c, "hidden_size": 0}, "hidden_size"),
}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, draft_dir):
    """An optkit artifact (RTN 4-bit of `draft`), whose manifest `inspect` and `eval` read."""
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    out = tmp_path_factory.mktemp("artifact") / "draft-w4"
    quantize_model(draft_dir, out, QuantizeOptions())
    return out


def crafted_copy(source, target, change):
    """`source` copied to `target` with config.json changed, and (where it has one) a manifest that
    lists the new config.json's sha256, as whoever crafted it would have written."""
    shutil.copytree(source, target)
    config = target / "config.json"
    config.write_text(json.dumps(change(json.loads(config.read_text()))))
    manifest = target / "optkit.json"
    if manifest.exists():
        data = json.loads(manifest.read_text())
        data["files"]["config.json"] = file_sha256(config)
        manifest.write_text(json.dumps(data))
    return target


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_config_is_one_line_in_every_command(case, run_cli, tmp_path, artifact, draft_dir):
    change, fragment = CRAFTED[case]
    crafted = crafted_copy(artifact, tmp_path / "crafted", change)
    assert_user_error(run_cli("inspect", crafted), fragment)
    assert_user_error(run_cli("generate", crafted, "hi", "--max-tokens", "2"), fragment)
    assert_user_error(run_cli("eval", crafted, "--baseline", draft_dir), fragment)
    assert_user_error(run_cli("eval", draft_dir, "--baseline", crafted), fragment)
    base = crafted_copy(draft_dir, tmp_path / "base", change)
    out = tmp_path / "outputs"
    out.mkdir()
    assert_user_error(run_cli("quantize", base, "--out", out / "q"), fragment)
    assert leftovers(out, "q") == []


def _address_space_of_4_gib():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("command", ["generate", "inspect"])
def test_head_dim_of_2_to_the_32_is_refused_before_any_allocation(command, tmp_path, artifact):
    """In a child process under a 4 GiB address space: the 16 GiB allocation this once tried would
    end it with a MemoryError (exit 3), or take the machine's memory without the limit."""
    crafted = crafted_copy(artifact, tmp_path / "crafted", lambda c: {**c, "head_dim": 2**32})
    args = [str(crafted), "hi", "--max-tokens", "2"] if command == "generate" else [str(crafted)]
    done = subprocess.run(
        [sys.executable, "-m", "optkit.cli.main", command, *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_address_space_of_4_gib,
    )
    assert_user_error((done.returncode, done.stdout, done.stderr), "head_dim")


def test_a_plain_model_whose_weights_contradict_its_config_is_one_line(run_cli, tmp_path, draft_dir):
    """Every size valid, but not the weights' (a doubled intermediate_size): the base of `eval`, a
    plain artifact of `eval`, and `bench`'s transformers baseline each say so in one line."""
    base = crafted_copy(draft_dir, tmp_path / "base", lambda c: {**c, "intermediate_size": 2 * c["intermediate_size"]})
    for command in (
        ("eval", draft_dir, "--baseline", base, "--max-windows", "1"),
        ("eval", base, "--baseline", draft_dir, "--max-windows", "1"),
        ("bench", base, "--batch-sizes", "1", "--baseline", "hf", "--prompt-len", "4", "--gen-len", "2"),
    ):
        assert_user_error(run_cli(*command), "down_proj.weight is [128, 384] in the checkpoint but [128, 768]")
