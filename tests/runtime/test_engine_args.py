"""One set of engine arguments: EngineArgs resolves device and dtype in one place, every command that
runs the engine takes its flags from it, and a recipe's serve.engine section has the same keys."""

import pytest
import torch

from optkit.cli.serve_flags import ServeFlags, apply_flags
from optkit.devices import resolve_device, resolve_dtype
from optkit.errors import OptkitError
from optkit.routing.config import serve_options
from optkit.runtime.engine_args import EngineArgs, EngineConfig


@pytest.fixture
def with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_is_the_cpu_and_float32_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = EngineArgs().engine_config()
    assert isinstance(config, EngineConfig) and (config.device, config.dtype) == ("cpu", "float32")


def test_auto_is_cuda_and_bfloat16_where_cuda_is(with_cuda):
    config = EngineArgs().engine_config()
    assert (config.device, config.dtype) == ("cuda", "bfloat16")
    assert EngineArgs(device="cpu").engine_config().dtype == "float32"
    assert EngineArgs(dtype="float32").engine_config().dtype == "float32"


def test_cuda_without_cuda_names_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(OptkitError, match="--device cuda asked for.*use --device cpu"):
        EngineArgs(device="cuda").engine_config()
    with pytest.raises(OptkitError, match="--device cuda:1"):
        resolve_device("cuda:1")


def test_a_bad_dtype_names_the_choices():
    with pytest.raises(OptkitError, match="unknown --dtype 'fp8'"):
        EngineArgs(dtype="fp8")
    with pytest.raises(OptkitError, match="unknown --dtype"):
        resolve_dtype("int4", "cpu")


def test_flags_not_given_keep_the_defaults():
    args = EngineArgs.from_cli_args(device=None, dtype=None, max_num_seqs=8, enforce_eager=None)
    assert args == EngineArgs(max_num_seqs=8)
    assert (args.device, args.dtype, args.enforce_eager) == ("auto", "auto", False)


def test_an_engine_config_built_directly_runs_on_the_cpu_in_float32():
    config = EngineConfig()
    assert isinstance(config, EngineArgs) and (config.device, config.dtype) == ("cpu", "float32")
    assert {name for name in EngineConfig.model_fields} == {name for name in EngineArgs.model_fields}


def test_the_serve_section_takes_the_engine_keys_and_flags_override_them_key_by_key():
    data = {"models": {"a": {"path": "small"}}, "engine": {"device": "cpu", "max_num_seqs": 8}}
    assert serve_options(data).engine == EngineArgs(device="cpu", max_num_seqs=8)
    merged = serve_options(apply_flags(data, ServeFlags(engine={"max_num_seqs": 4, "dtype": "bfloat16"})))
    assert merged.engine == EngineArgs(device="cpu", max_num_seqs=4, dtype="bfloat16")
    assert serve_options({"models": {"a": {"path": "small"}}}).engine == EngineArgs()


def test_an_unknown_engine_key_is_named_with_the_nearest():
    with pytest.raises(OptkitError, match="serve key 'engine.max_num_seq' is unknown: did you mean 'max_num_seqs'"):
        serve_options({"models": {"a": {"path": "small"}}, "engine": {"max_num_seq": 8}})


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "compile"])
def test_every_engine_command_takes_device_and_dtype_defaulting_to_auto(run_cli, command):
    code, out, _ = run_cli(command, "--help")
    assert code == 0
    assert "--device" in out and "--dtype" in out and "default: auto" in out


def test_threads_and_head_are_engine_settings_with_flags_named_in_errors():
    with pytest.raises(OptkitError, match="unknown --head 'int4'"):
        EngineArgs(head="int4")
    with pytest.raises(OptkitError, match="--threads 0"):
        EngineArgs(threads=0)
    assert EngineArgs.from_cli_args(threads=None, head=None) == EngineArgs()


def test_the_engine_takes_its_threads_and_output_head_from_its_config():
    from optkit.kernels.w8a8 import W8A8Linear
    from optkit.runtime.engine import LLMEngine

    before = torch.get_num_threads()
    try:
        engine = LLMEngine("draft", EngineConfig(threads=1, head="int8", max_model_len=64))
        assert torch.get_num_threads() == 1
        assert isinstance(engine.model.lm_head, W8A8Linear)
        assert LLMEngine("draft", EngineConfig(max_model_len=64)).model.lm_head is None  # full: the tied embedding
    finally:
        torch.set_num_threads(before)


def test_generate_takes_the_threads_and_head_flags(run_cli):
    before = torch.get_num_threads()
    try:
        flags = ("--max-tokens", "2", "--threads", "1", "--head", "int8")
        code, _, err = run_cli("generate", "draft", "def f(x):", *flags)
        assert code == 0, err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
