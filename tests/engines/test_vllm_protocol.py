"""The vLLM worker protocol from optkit's side (optkit/engines/vllm.py), against a fake worker
(fake_vllm_worker.py: the protocol spoken by optkit's own python, the model run as the gate runs it),
so every failure a user can meet without vLLM is one line: a missing python, an old vLLM, a worker
that dies mid-request, one that speaks nonsense, one that hangs, and a model vLLM refuses."""

import stat
import sys
from pathlib import Path

import pytest
import torch

from optkit.engines.vllm import (
    ENV_PYTHON,
    Timeouts,
    VllmRefused,
    VllmWorker,
    root_cause,
    vllm_dtype,
    vllm_python,
)
from optkit.engines.vllm_cpu import VllmCpu
from optkit.errors import OptkitError

FAKE = Path(__file__).with_name("fake_vllm_worker.py")


def fake_python(tmp_path: Path, mode: str = "ok") -> Path:
    """An executable that stands where vLLM's python would: it runs the fake worker in `mode`."""
    path = tmp_path / f"python-{mode}"
    path.write_text(f'#!/bin/sh\nFAKE_VLLM_MODE={mode} exec "{sys.executable}" "{FAKE}"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_no_vllm_python_says_what_to_install(monkeypatch):
    monkeypatch.delenv(ENV_PYTHON, raising=False)
    with pytest.raises(OptkitError, match="--vllm-python PATH or set OPTKIT_VLLM_PYTHON.*make vllm") as e:
        vllm_python(None)
    assert "\n" not in str(e.value)


def test_a_vllm_python_that_is_not_there_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_PYTHON, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(OptkitError, match=r"OPTKIT_VLLM_PYTHON .*nowhere/python is not an executable file"):
        vllm_python(None)
    assert vllm_python(fake_python(tmp_path)) == fake_python(tmp_path)  # the flag wins over the environment


def test_an_old_vllm_is_refused_at_hello(tmp_path):
    with pytest.raises(OptkitError, match=r"has vLLM 0\.31\.0; optkit's worker needs vLLM 0\.32\.x.*make vllm"):
        VllmWorker(fake_python(tmp_path, "old"))


def test_a_worker_that_dies_mid_score_shows_its_last_stderr_line(tmp_path, small_dir):
    worker = VllmWorker(fake_python(tmp_path, "die_on_score"))
    worker.load(small_dir, dtype="float32", max_model_len=17)
    with pytest.raises(OptkitError, match=r"exited with code 139 during score: Fatal Python error: Segmentation"):
        worker.score(torch.ones(1, 16, dtype=torch.long), torch.zeros(1, 15, 2, dtype=torch.long))
    assert worker.process.poll() is not None
    worker.close()
    assert not worker.tmp.exists()


def test_a_line_that_is_not_the_protocol_ends_the_worker(tmp_path):
    worker = VllmWorker(fake_python(tmp_path, "garbage"))
    with pytest.raises(OptkitError, match="not a protocol message during load: INFO 12-01 loading the model"):
        worker.load("m", dtype="float32", max_model_len=8)
    assert worker.process.poll() is not None


def test_a_worker_that_hangs_times_out(tmp_path):
    worker = VllmWorker(fake_python(tmp_path, "hang"), Timeouts(load=1))
    with pytest.raises(OptkitError, match=r"did not answer load within 1 s"):
        worker.load("m", dtype="float32", max_model_len=8)
    assert worker.process.poll() is not None  # killed, with its process group


def test_a_refused_model_carries_vllms_own_reason_and_the_worker_stays_up(tmp_path, small_dir):
    with VllmWorker(fake_python(tmp_path, "refuse")) as worker:
        with pytest.raises(VllmRefused, match=r"small-w4: RuntimeError: cpu_gemm_wna16 not implemented for 'Float'"):
            worker.load("out/small-w4", dtype="float32", max_model_len=8)
        assert worker.process.poll() is None
        process = worker.process
    assert process.poll() == 0  # close() asked it to shut down, and it did


def test_score_returns_the_log_probs_at_the_ids_asked_for(tmp_path, small_dir):
    from optkit.quant.formats.load import load_model

    windows = torch.randint(1, 4000, (2, 12))
    ids = torch.randint(0, 4096, (2, 11, 3))
    with VllmWorker(fake_python(tmp_path)) as worker:
        info = worker.load(small_dir, dtype="float32", max_model_len=13)
        got = worker.score(windows, ids)
        dense = worker.prompt_logprobs(windows)["logp"]
    model = load_model(small_dir)
    with torch.inference_mode():
        logp = torch.log_softmax(model(windows).logits[:, :-1], dim=-1)
    assert info["vocab_size"] == 4096 and info["vllm"] == "0.32.0"
    torch.testing.assert_close(got.logp_at_ids, logp.gather(-1, ids))
    torch.testing.assert_close(got.target_logp, logp.gather(-1, windows[:, 1:, None])[..., 0])
    assert torch.equal(got.argmax, logp.argmax(-1))
    torch.testing.assert_close(dense, logp)


@pytest.mark.parametrize(
    ("quantization_config", "dtype"),
    [
        (None, "float32"),
        ({"quant_method": "gptq", "bits": 4}, "bfloat16"),
        ({"quant_method": "awq", "bits": 4}, "bfloat16"),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
            "bfloat16",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8}}
                },
            },
            "float32",
        ),  # W8A8 int8
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "float"}, "input_activations": {"num_bits": 8}}
                },
            },
            "float32",
        ),  # FP8
    ],
)
def test_vllm_cpu_runs_weight_only_ints_in_bfloat16_and_the_rest_in_float32(quantization_config, dtype):
    assert vllm_dtype(quantization_config, VllmCpu(avx512=True, amx=False)) == dtype


def test_on_a_cpu_with_amx_vllm_runs_w8a8_int8_in_bfloat16_and_fp8_in_float32():
    amx = VllmCpu(avx512=True, amx=True)
    w8a8 = {"weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}
    fp8 = {"weights": {"num_bits": 8, "type": "float"}, "input_activations": {"num_bits": 8, "type": "float"}}
    ct = {"quant_method": "compressed-tensors"}
    assert vllm_dtype({**ct, "config_groups": {"g": w8a8}}, amx) == "bfloat16"
    assert vllm_dtype({**ct, "config_groups": {"g": fp8}}, amx) == "float32"
    assert vllm_dtype(None, amx) == "float32"


def test_the_worker_imports_nothing_from_optkit():
    source = (Path(__file__).parents[2] / "optkit" / "engines" / "vllm_worker.py").read_text()
    assert "optkit" not in "".join(line for line in source.splitlines() if line.lstrip().startswith(("import", "from")))


def test_the_root_cause_is_the_deepest_exception_vllm_logged():
    log = [
        "(VllmWorker-0 pid=16021) ERROR 12-01 19:19:57 [multiproc_executor.py:953] ValueError: Available memory on "
        "node 0 (20.78/23.54 GiB) on startup is less than desired CPU memory utilization",
        "(EngineCore pid=15825) ERROR 12-01 19:20:02 [core.py:1510] Exception: WorkerProc initialization failed due "
        "to an exception in a background process. See stack trace for root cause.",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
    ]
    assert root_cause(log).startswith("ValueError: Available memory on node 0")
    assert root_cause(["INFO 12-01 19:20:02 [core.py:1] loading"]) is None
