"""Tokenizers load without running code from the model directory (issue 30, section 5): a tokenizer
that needs the code `auto_map` names is refused in one line (it was a traceback), the code itself
never runs, and a malformed tokenizer_config.json is one line too."""

import json
import shutil

import pytest

from optkit.errors import OptkitError
from optkit.modeldir import load_tokenizer
from tests.cli.test_bad_input import assert_user_error

# the code a crafted model directory ships: were it imported, it would leave a file behind
PAYLOAD = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('remote code ran')\n"


def with_tokenizer_config(draft_dir, target, change):
    shutil.copytree(draft_dir, target)
    (target / "evil_tokenizer.py").write_text(PAYLOAD)
    file = target / "tokenizer_config.json"
    file.write_text(json.dumps(change(json.loads(file.read_text()))))
    return target


def remote(config):
    return {**config, "tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil_tokenizer.Evil", None]}}


def test_a_tokenizer_that_needs_remote_code_is_one_line(tmp_path, draft_dir, run_cli):
    model = with_tokenizer_config(draft_dir, tmp_path / "model", remote)
    with pytest.raises(OptkitError, match="custom code"):
        load_tokenizer(model)
    assert_user_error(run_cli("generate", model, "hi", "--max-tokens", "2"), "auto_map", "never runs code")
    assert not (model / "RAN").exists()


def test_auto_map_beside_a_shipped_tokenizer_class_loads_that_class(tmp_path, draft_dir):
    """transformers has the class itself: the auto_map is ignored and nothing is run."""
    model = with_tokenizer_config(
        draft_dir,
        tmp_path / "shipped",
        lambda c: {**c, "auto_map": {"AutoTokenizer": ["evil_tokenizer.Evil", None]}},
    )
    assert load_tokenizer(model).encode("hello")
    assert not (model / "RAN").exists()


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("[1]", "holds no JSON object"),
        ('{"model_max_length": 1' + "0" * 5000 + "}", "number too long"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("{bad", "not valid JSON"),
        ('{"tokenizer_class": 5}', "tokenizer_class"),
        ('{"tokenizer_class": "Evil", "auto_map": "evil_tokenizer.Evil"}', "auto_map"),
    ],
)
def test_a_malformed_tokenizer_config_is_one_line(tmp_path, draft_dir, run_cli, content, fragment):
    model = tmp_path / "model"
    shutil.copytree(draft_dir, model)
    (model / "tokenizer_config.json").write_text(content)
    assert_user_error(run_cli("generate", model, "hi", "--max-tokens", "2"), "tokenizer_config.json", fragment)


@pytest.mark.parametrize(
    "file, content, fragment",
    [
        ("generation_config.json", '{"eos_token_id": 1' + "0" * 5000 + "}", "number too long"),
        ("model.safetensors.index.json", "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("tokenizer.json", '{"model": []}', "byte-level BPE"),
    ],
)
def test_every_json_file_of_a_model_directory_is_one_line_however_it_is_broken(
    tmp_path, draft_dir, run_cli, file, content, fragment
):
    model = tmp_path / "model"
    shutil.copytree(draft_dir, model)
    (model / file).write_text(content)
    if file == "model.safetensors.index.json":
        (model / "model.safetensors").unlink()  # a sharded checkpoint: the index says where the weights are
    command = ("quantize", model, "--format", "gguf", "--group-size", "32", "--out", tmp_path / "m.gguf")
    if file != "tokenizer.json":
        command = ("generate", model, "hi", "--max-tokens", "2")
    assert_user_error(run_cli(*command), file, fragment)
