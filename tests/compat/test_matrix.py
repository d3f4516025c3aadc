"""Every artifact kind optkit writes, in every loader a user would reach for (optkit/compat/matrix.py).

Each cell asserts what the matrix expects: "loads" (no missing, unexpected, mismatched or newly
initialised keys; logits within tolerance of optkit's runtime), "fails" (a known upstream
breakage: the test fails once upstream fixes it, so the matrix gets updated), or "by spec" (vLLM,
checked against what its loaders create). The whole cross-product runs by default: tiny models
and cut-short searches keep it under a minute on 2 cores.
"""

import importlib.metadata
import json
from pathlib import Path

import pytest

from optkit.compat import matrix
from optkit.compat.transformers_load import check_transformers_load
from optkit.compat.vllm_spec import check_vllm_spec
from optkit.quant.calibration_data import CalibrationOptions
from optkit.quant.formats.kind import ArtifactKind
from optkit.quant.methods.awq.options import AWQOptions
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import FP8_PER_CHANNEL, W8_PER_CHANNEL, WeightScheme
from tests.tiny_families import FAMILIES

CALIB = CalibrationOptions(num_samples=8, seq_len=64)
# The layout, not the numbers, decides loading: AWQ's searches cut short (same tensors, same config)
AWQ = AWQOptions(grid=5, duo_scaling="on", clip_steps=4)
BITS = {"compressed-tensors": (2, 3, 4, 8), "gptq": (2, 3, 4, 8), "awq": (4,)}
WORKAROUND_RTOL = 1e-2  # paths that dequantize or multiply in half precision
SYMMETRY = {"compressed-tensors": (True, False), "gptq": (True,), "awq": (True, False)}


def _cells():
    for fmt, bits_list in BITS.items():
        for bits in bits_list:
            for symmetric in SYMMETRY[fmt]:
                for method in ("rtn", "gptq", "awq"):
                    name = f"{method}-{fmt}-w{bits}-{'sym' if symmetric else 'asym'}"
                    yield pytest.param(method, fmt, bits, symmetric, "none", id=name)
    for activations in ("dynamic", "static"):
        yield pytest.param(
            "smoothquant", "compressed-tensors", 8, True, activations, id=f"smoothquant-w8a8-{activations}"
        )
        yield pytest.param("fp8", "compressed-tensors", 8, True, activations, id=f"fp8-w8a8-{activations}")
    for double_quant in ("none", "double-quant"):  # NF4: "activations" carries double quantization
        yield pytest.param("nf4", "bitsandbytes", 4, True, double_quant, id=f"nf4-bitsandbytes-{double_quant}")


def _quantize(model_dir: Path, out: Path, method: str, fmt: str, bits: int, symmetric: bool, activations: str) -> Path:
    if method in ("smoothquant", "fp8"):
        options = QuantizeOptions(
            method=method,
            weights=W8_PER_CHANNEL if method == "smoothquant" else FP8_PER_CHANNEL,
            calibration=CALIB,
            **{method: {"activations": activations}},  # quantize.smoothquant or quantize.fp8
        )
    elif method == "nf4":
        pytest.importorskip("bitsandbytes")  # transformers reads NF4 through it (the bnb extra)
        scheme = WeightScheme(bits=4, group_size=64, type="nf4", double_quant=activations == "double-quant")
        options = QuantizeOptions(method=method, format=fmt, weights=scheme)
    else:
        scheme = WeightScheme(bits=bits, group_size=64, symmetric=symmetric)
        options = QuantizeOptions(method=method, format=fmt, weights=scheme, calibration=CALIB, awq=AWQ)
    quantize_model(model_dir, out, options)
    return out


def _versions() -> dict[str, str | None]:
    return {p: matrix.installed_version(p) for p in ("transformers", "compressed-tensors", "torch", "gptqmodel")}


def _linear_shapes(path: Path) -> dict[str, tuple[int, int]]:
    from transformers import AutoConfig

    from optkit.manifest import read_manifest
    from optkit.quant.targets import decoder_linears

    ignored = set(read_manifest(path)["ignored_layers"])
    return {
        t.name: (t.out_features, t.in_features)
        for t in decoder_linears(AutoConfig.from_pretrained(path))
        if t.name not in ignored
    }


def _vllm_problems(path: Path) -> list[str]:
    from optkit.modeldir import read_config, read_tensors

    return check_vllm_spec(read_config(path), read_tensors(path), _linear_shapes(path))


REFERENCE_ATOL = 2e-2  # optkit's runtime vs the dequantized reference: its int kernels round differently


def _runtime_vs_dequantized_reference(path: Path) -> float:
    """Largest |logit| difference between optkit's runtime on the artifact and the transformers
    model holding the artifact's own dequantized tensors (quant/formats/load.py)."""
    import torch

    from optkit.compat.transformers_load import sample_sequences
    from optkit.kernels import cpu_int4
    from optkit.models.loader import load_runtime_model
    from optkit.quant.formats.load import load_model
    from tests.models.paged import run_paged, whole_prefills

    sequences = sample_sequences(json.loads((path / "config.json").read_text())["vocab_size"])
    with cpu_int4.reference_only():  # the artifact's semantics; the int4 kernel is bounded in tests/models
        runtime = run_paged(load_runtime_model(path), sequences, whole_prefills([len(s) for s in sequences]), 16)
    reference = load_model(path)
    with torch.no_grad():
        expected = [reference(torch.tensor([s])).logits[0] for s in sequences]
    return max((got - want).abs().max().item() for got, want in zip(runtime, expected, strict=True))


def check_cell(path: Path, kind: ArtifactKind, row: str, method: str, record) -> None:
    """Assert every loader's expected outcome for one artifact and record what was measured."""
    versions = _versions()
    cell = {
        "row": row,
        "method": method,
        "kind": kind.describe(),
        "format": kind.format,
        "bits": kind.bits,
        "symmetric": kind.symmetric,
        "w8a8": kind.w8a8,
        "type": kind.type,
        "versions": versions,
    }
    # optkit's runtime and transformers both: the check loads the runtime model as its reference
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    expected = matrix.expected_status(kind, matrix.TRANSFORMERS, versions, model_type)
    family_breakages = matrix.family_breakages(model_type, matrix.TRANSFORMERS, versions, kind.format)
    if expected == "fails" and family_breakages:  # MoE: against the artifact's own dequantized tensors
        result = check_transformers_load(path)
        if result.ok and kind.type == "float":
            # FP8 experts are decompressed into transformers' fused bf16 experts: a drift of the
            # logits, not a layout failure, so a model with few MoE layers may stay inside the W8A8
            # tolerance (the tiny Qwen2-MoE, one MoE layer of two: 0.128 against 0.134, where
            # Mixtral and Qwen3-MoE miss by 3-4x). Recorded as measured.
            record({**cell, "loader": matrix.TRANSFORMERS, "status": "loads", "max_abs_diff": result.max_abs_diff})
        else:
            assert not result.ok, f"{model_type} {kind.describe()} now loads in transformers: update the matrix"
            record({**cell, "loader": matrix.TRANSFORMERS, "status": "fails", "problem": family_breakages[0].summary})
        assert _runtime_vs_dequantized_reference(path) <= REFERENCE_ATOL
        record({**cell, "loader": matrix.OPTKIT, "status": "loads"})
    elif expected == "no":
        from optkit.models.loader import load_runtime_model

        load_runtime_model(path)
        record({**cell, "loader": matrix.OPTKIT, "status": "loads"})
    else:
        result = check_transformers_load(path)
        if expected == "loads":
            assert result.ok, result.problems
            record({**cell, "loader": matrix.OPTKIT, "status": "loads"})
            record({**cell, "loader": matrix.TRANSFORMERS, "status": "loads", "max_abs_diff": result.max_abs_diff})
        else:
            assert not result.ok, (
                f"{kind.describe()} now loads in transformers {versions['transformers']}: update BREAKAGES"
            )
            breakage = matrix.known_breakages(kind, versions)[0]
            assert any("MISMATCH" in p or "mismatch" in p for p in result.problems), result.problems
            record({**cell, "loader": matrix.TRANSFORMERS, "status": "fails", "problem": breakage.summary})
            # The workaround the warning gives: dequantize at load time. It dequantizes in the
            # scales' dtype (bf16 here), so its logits sit within bf16 rounding, not fp32's.
            from transformers import CompressedTensorsConfig

            workaround = check_transformers_load(
                path, rtol=WORKAROUND_RTOL, quantization_config=CompressedTensorsConfig(dequantize=True)
            )
            assert workaround.ok, workaround.problems
            record({**cell, "loader": matrix.OPTKIT, "status": "loads"})
            record(
                {
                    **cell,
                    "loader": "transformers, dequantize=True",
                    "status": "loads",
                    "max_abs_diff": workaround.max_abs_diff,
                }
            )
    # gptqmodel: an optional extra; without it the cell stays "untested" in the docs
    if kind.format in ("gptq", "awq"):
        try:
            importlib.metadata.version("gptqmodel")
        except importlib.metadata.PackageNotFoundError:
            record({**cell, "loader": matrix.GPTQMODEL, "status": "untested"})
        else:  # gptqmodel's CPU kernels compute in half precision: bf16-rounding tolerance
            result = check_transformers_load(path, rtol=WORKAROUND_RTOL)
            record(
                {
                    **cell,
                    "loader": matrix.GPTQMODEL,
                    "status": "loads" if result.ok else "fails",
                    "problem": "; ".join(result.problems)[:200],
                }
            )
    # vLLM, by spec
    problems = _vllm_problems(path)
    if matrix.vllm_path(kind) is None:
        assert problems and "no loader" in problems[0]
        record({**cell, "loader": matrix.VLLM, "status": "no", "problem": problems[0]})
    else:
        assert problems == []
        record({**cell, "loader": matrix.VLLM, "status": "by spec", "path": matrix.vllm_path(kind)})


@pytest.mark.parametrize(("method", "fmt", "bits", "symmetric", "activations"), list(_cells()))
def test_artifact_loads_where_the_matrix_says(tmp_path, draft_dir, record, method, fmt, bits, symmetric, activations):
    path = _quantize(draft_dir, tmp_path / "artifact", method, fmt, bits, symmetric, activations)
    kind = _kind(method, fmt, bits, symmetric)
    check_cell(
        path, kind, "draft (llama, trained)", method if activations == "none" else f"{method} ({activations})", record
    )


FAMILY_CELLS = {
    "ct-w4-sym": ("rtn", "compressed-tensors", 4, True),
    "ct-w4-asym": ("rtn", "compressed-tensors", 4, False),
    "gptq-w4": ("gptq", "gptq", 4, True),
    "awq-w4-asym": ("awq", "awq", 4, False),
    "w8a8": ("smoothquant", "compressed-tensors", 8, True),
    "fp8": ("fp8", "compressed-tensors", 8, True),
    "nf4": ("nf4", "bitsandbytes", 4, True),
}


def _kind(method: str, fmt: str, bits: int, symmetric: bool) -> ArtifactKind:
    w8a8 = method in ("smoothquant", "fp8")
    return ArtifactKind(fmt, bits, symmetric, w8a8=w8a8, type={"fp8": "float", "nf4": "nf4"}.get(method, "int"))


def _family_cells():
    for family in FAMILIES:
        for name, cell in FAMILY_CELLS.items():
            yield pytest.param(family, *cell, id=f"{family}-{name}")


@pytest.mark.parametrize(("family", "method", "fmt", "bits", "symmetric"), list(_family_cells()))
def test_every_family_loads_where_the_matrix_says(tmp_path, family_dir, record, family, method, fmt, bits, symmetric):
    activations = "dynamic" if method in ("smoothquant", "fp8") else "none"
    path = _quantize(family_dir(family), tmp_path / "artifact", method, fmt, bits, symmetric, activations)
    kind = _kind(method, fmt, bits, symmetric)
    check_cell(path, kind, f"{family} (tiny, random)", method, record)
