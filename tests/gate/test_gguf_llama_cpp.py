"""GGUF files checked by llama.cpp itself (llama-cpp-python, the extra `optkit[gguf]`; skipped
without it): the tokenizer round-trips, llama.cpp agrees with optkit's runtime on the same weights,
calibration pays in llama.cpp, and `optkit eval model.gguf` gates through it."""

import json
import math
import os

import pytest
import torch

from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.errors import OptkitError
from optkit.gate.llama_cpp import LlamaCppModel, idle_cores, llama_cpp_available
from optkit.modeldir import load_tokenizer, resolve_model_dir
from optkit.models.loader import load_runtime_model
from optkit.quant.formats.gguf_read import write_model_dir
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.models.paged import run_paged, whole_prefills
from tests.tiny_families import FAMILIES, save_tiny_family

pytestmark = pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")

SEQ_LEN = 256
TYPES = {"Q4_0": (4, True), "Q4_1": (4, False), "Q8_0": (8, True)}


def quantize_gguf(model, out, qtype="Q4_0", method="rtn", num_samples=32):
    bits, sym = TYPES[qtype]
    options = QuantizeOptions(
        method=method,
        weights=WeightScheme(bits=bits, group_size=32, symmetric=sym),
        format="gguf",
        calibration={"num_samples": num_samples, "seq_len": SEQ_LEN},
    )
    quantize_model(model, out, options)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """small as RTN Q4_0, Q4_1 and Q8_0 (made once for the module; GPTQ's file is the slow test's)."""
    root = tmp_path_factory.mktemp("gguf")
    return {f"rtn-{qtype}": quantize_gguf("small", root / f"rtn-{qtype}.gguf", qtype) for qtype in TYPES}


def heldout_windows(count: int) -> torch.Tensor:
    tokenizer = load_tokenizer("small")
    return pack_windows(tokenize_stream(tokenizer, load_text_set("heldout").texts), SEQ_LEN, count)


def test_small_tokenizer_round_trips_through_llama_cpp(files):
    """llama.cpp's token ids for a text are transformers' ids, on held-out code and odd text."""
    tokenizer = load_tokenizer("small")
    llama = LlamaCppModel(files["rtn-Q4_1"], n_ctx=SEQ_LEN)
    texts = load_text_set("heldout").texts[:40] + [
        "def f(x):\n\treturn x  # tabs, 'quotes' and    runs of spaces\n\n\n",
        "I've been told he'll say 3.14159 ≈ π — naïve café 日本語 🦙🦙 <|endoftext|> done",
        "   leading spaces, trailing spaces   ",
    ]
    for text in texts:
        assert llama.tokenize(text) == tokenizer(text, add_special_tokens=False)["input_ids"], text[:60]
    llama.close()


def _agreement(gguf_file, tmp_path, windows):
    """(top-1 agreement, llama.cpp ppl / runtime ppl) on `windows`, teacher-forced."""
    llama = LlamaCppModel(gguf_file, n_ctx=SEQ_LEN)
    llama_logits = llama(windows).logits[:, :-1]
    llama.close()
    runtime = load_runtime_model(write_model_dir(gguf_file, tmp_path / gguf_file.stem))
    sequences = windows.tolist()
    with torch.inference_mode():
        runtime_logits = torch.stack(run_paged(runtime, sequences, whole_prefills([SEQ_LEN] * len(sequences))))
    runtime_logits = runtime_logits[:, :-1]
    targets = windows[:, 1:].unsqueeze(-1)

    def ppl(logits):
        return math.exp(-torch.log_softmax(logits.float(), -1).gather(-1, targets).mean().item())

    top1 = (llama_logits.argmax(-1) == runtime_logits.argmax(-1)).double().mean().item()
    return top1, ppl(llama_logits) / ppl(runtime_logits)


@pytest.mark.parametrize("name", ["rtn-Q4_0", "rtn-Q4_1", "rtn-Q8_0"])
def test_llama_cpp_agrees_with_optkits_runtime_on_the_same_weights(files, tmp_path, name):
    """Same weights, two runtimes: llama.cpp (8-bit activations in its dot products) against optkit's
    runtime on the file's dequantized weights, teacher-forced on held-out windows."""
    top1, ppl_ratio = _agreement(files[name], tmp_path, heldout_windows(8))
    print(f"{name}: top-1 agreement {100 * top1:.2f}%, ppl ratio {ppl_ratio:.4f}")
    assert top1 >= 0.98
    assert abs(ppl_ratio - 1) <= 0.01


def test_llama_cpps_logits_do_not_depend_on_its_thread_count(files, monkeypatch):
    """The gate picks llama.cpp's threads by the idle cores (gate/llama_cpp.idle_cores): a verdict
    must not depend on how busy the machine was."""
    windows = heldout_windows(2)
    logits = []
    for threads in (1, 2):
        llama = LlamaCppModel(files["rtn-Q4_0"], n_ctx=SEQ_LEN, n_threads=threads)
        logits.append(llama(windows).logits)
        llama.close()
    assert torch.equal(logits[0], logits[1])
    monkeypatch.setenv("OPTKIT_LLAMA_CPP_THREADS", "3")
    llama = LlamaCppModel(files["rtn-Q4_0"], n_ctx=SEQ_LEN)
    assert llama.n_threads == 3
    llama.close()
    monkeypatch.setenv("OPTKIT_LLAMA_CPP_THREADS", "many")
    with pytest.raises(OptkitError, match="OPTKIT_LLAMA_CPP_THREADS='many': give a positive number"):
        LlamaCppModel(files["rtn-Q4_0"], n_ctx=SEQ_LEN)
    assert 1 <= idle_cores() <= (os.cpu_count() or 1)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_family_runs_in_llama_cpp_as_in_optkit(tmp_path, monkeypatch, family):
    """Each family's file loads in llama.cpp and computes what optkit's runtime computes (tiny random
    models: flat distributions, so the logits are compared, not only the top token)."""
    monkeypatch.setitem(FAMILIES, "qwen3", {**FAMILIES["qwen3"], "attention_bias": False})  # as Qwen3 ships
    model = save_tiny_family(family, tmp_path / family, resolve_model_dir("small"))
    gguf_file = quantize_gguf(model, tmp_path / f"{family}.gguf", "Q8_0")
    windows = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    llama = LlamaCppModel(gguf_file, n_ctx=64)
    llama_logits = llama(windows).logits
    llama.close()
    runtime = load_runtime_model(write_model_dir(gguf_file, tmp_path / "back"))
    with torch.inference_mode():
        runtime_logits = torch.stack(run_paged(runtime, windows.tolist(), whole_prefills([64, 64])))
    spread = runtime_logits.std().item()
    assert (llama_logits - runtime_logits).abs().mean().item() < 0.05 * spread


@pytest.mark.slow
def test_gptq_q4_0_has_lower_perplexity_in_llama_cpp_than_rtn(tmp_path, run_cli):
    """Calibration pays in llama.cpp: GPTQ's Q4_0 file (its GGUF defaults: act-order, static groups,
    llama.cpp's scale rule) beats RTN's on the whole `heldout` set (187 windows) in perplexity and KLD,
    as `optkit eval` measures it."""
    rtn = quantize_gguf("small", tmp_path / "rtn.gguf")
    gptq = quantize_gguf("small", tmp_path / "gptq.gguf", method="gptq", num_samples=128)
    ppl, kld = {}, {}
    for name, path in (("rtn", rtn), ("gptq", gptq)):
        report = tmp_path / f"{name}.json"
        code, _, err = run_cli("eval", path, "--baseline", "small", "--report", report)
        assert code == 0, err
        metrics = json.loads(report.read_text())["metrics"]
        ppl[name], kld[name] = metrics["ppl_artifact"], metrics["kld_mean"]
    print(f"llama.cpp heldout ppl: RTN Q4_0 {ppl['rtn']:.4f}, GPTQ Q4_0 {ppl['gptq']:.4f}")
    assert ppl["gptq"] < ppl["rtn"] and kld["gptq"] < kld["rtn"]


def test_eval_gates_a_gguf_through_llama_cpp_with_the_usual_exit_codes(files, tmp_path, run_cli):
    report = tmp_path / "gate.json"
    code, _, err = run_cli(
        "eval", files["rtn-Q8_0"], "--baseline", "small", "--max-windows", "4", "--min-top1", "90", "--report", report
    )
    assert code == 0, err
    result = json.loads(report.read_text())
    assert result["verdict"] == "pass" and result["eval_set"]["windows"] == 4
    assert result["metrics"]["ppl_increase_pct"] < 1 and result["metrics"]["top1_pct"] >= 90
    code, _, err = run_cli("eval", files["rtn-Q4_0"], "--baseline", "small", "--max-windows", "4", "--max-kld", "1e-6")
    assert code == 1, err
