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
def test_every_engine_command_takes_device_and_dtype_defaulting_to_auto(run_cli, command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the help at any terminal width: a narrow one elides the flag names
    code, out, _ = run_cli(command, "--help")
    assert code == 0
    assert "--device" in out and "--dtype" in out and "default: auto" in out


def test_threads_is_an_engine_setting_with_its_flag_named_in_errors_and_the_head_is_not():
    with pytest.raises(OptkitError, match="--threads 0"):
        EngineArgs(threads=0)
    assert EngineArgs.from_cli_args(threads=None) == EngineArgs()
    assert "head" not in EngineArgs.model_fields  # the artifact says how its head runs (quantize --head)


def test_the_engine_takes_its_threads_from_its_config_and_its_head_from_the_artifact(tmp_path):
    from optkit.kernels.w8a8 import W8A8Linear
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.runtime.engine import LLMEngine

    before = torch.get_num_threads()
    try:
        assert LLMEngine("draft", EngineConfig(threads=1, max_model_len=64)).model.lm_head is None  # tied embedding
        assert torch.get_num_threads() == 1
        quantize_model("draft", tmp_path / "head8", QuantizeOptions(head="int8"))
        engine = LLMEngine(tmp_path / "head8", EngineConfig(max_model_len=64))
        assert isinstance(engine.model.lm_head, W8A8Linear)
    finally:
        torch.set_num_threads(before)


def test_generate_takes_the_threads_flag_and_no_runtime_head_flag(run_cli):
    before = torch.get_num_threads()
    try:
        code, _, err = run_cli("generate", "draft", "def f(x):", "--max-tokens", "2", "--threads", "1")
        assert code == 0, err
        assert torch.get_num_threads() == 1
        code, _, err = run_cli("generate", "draft", "def f(x):", "--max-tokens", "2", "--head", "int8")
        assert code == 2 and "--head" in err  # the head runs as the artifact stores it (quantize --head)
    finally:
        torch.set_num_threads(before)


def test_multi_step_decoding_is_the_cpus_default_and_excludes_speculation(with_cuda):
    from optkit.runtime.engine_args import CPU_SCHEDULER_STEPS

    assert EngineArgs(device="cpu").engine_config().scheduler_steps() == CPU_SCHEDULER_STEPS > 1
    assert EngineArgs().engine_config().scheduler_steps() == 1  # CUDA: decode steps replay CUDA graphs
    assert EngineArgs(device="cpu", speculative="ngram").engine_config().scheduler_steps() == 1
    assert EngineArgs(device="cpu", num_scheduler_steps=3).engine_config().scheduler_steps() == 3
    with pytest.raises(OptkitError, match="--num-scheduler-steps must be at least 1"):
        EngineArgs(num_scheduler_steps=0)
    with pytest.raises(OptkitError, match="--num-scheduler-steps above 1 and --speculative exclude each other"):
        EngineArgs(num_scheduler_steps=4, speculative="ngram")
