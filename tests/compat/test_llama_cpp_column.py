"""The compatibility matrix's llama.cpp column: every GGUF kind optkit writes loads in llama.cpp (and
computes what optkit's runtime computes on the file's weights), for the trained draft model and each
family llama.cpp shares with optkit; no other loader reads GGUF, and llama.cpp reads nothing else."""

import pytest
import torch

from optkit.compat import matrix
from optkit.gate.llama_cpp import LlamaCppModel, llama_cpp_available
from optkit.models.loader import load_runtime_model
from optkit.quant.formats.gguf_read import read_config, write_model_dir
from optkit.quant.formats.kind import ArtifactKind
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.compat.test_matrix import _versions
from tests.models.paged import run_paged, whole_prefills
from tests.tiny_families import FAMILIES, save_tiny_family

KINDS = {"Q4_0": ("gptq", 4, True), "Q4_1": ("awq", 4, False), "Q8_0": ("rtn", 8, True)}
CALIB = {"num_samples": 8, "seq_len": 64}


def test_the_matrix_says_only_llama_cpp_reads_gguf_and_it_reads_only_gguf():
    for qtype, (_, bits, symmetric) in KINDS.items():
        config = {"quant_method": "gguf", "type": qtype, "bits": bits, "sym": symmetric, "group_size": 32}
        kind = matrix.kind_from_quant_config(config)
        assert kind == ArtifactKind("gguf", bits, symmetric) and kind.describe() == f"gguf {qtype}"
        assert dict(matrix.where_it_loads(kind)) == {
            loader: ("loads" if loader == matrix.LLAMA_CPP else "no") for loader in matrix.LOADERS
        }
    assert matrix.expected_status(ArtifactKind("compressed-tensors", 4, True), matrix.LLAMA_CPP) == "no"


def _cells():
    """Every kind on the trained draft model; each family once (the block types do not depend on it)."""
    for qtype in KINDS:
        yield pytest.param("draft", qtype, id=f"draft-{qtype}")
    for row in ("llama", "mistral", "qwen2", "qwen3"):
        yield pytest.param(row, "Q8_0", id=f"{row}-Q8_0")


@pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")
@pytest.mark.parametrize(("row", "qtype"), list(_cells()))
def test_gguf_loads_in_llama_cpp_where_the_matrix_says(
    tmp_path, monkeypatch, draft_dir, family_dir, record, row, qtype
):
    method, bits, symmetric = KINDS[qtype]
    if row == "qwen3":  # as Qwen3 ships: llama.cpp has no place for attention biases
        monkeypatch.setitem(FAMILIES, "qwen3", {**FAMILIES["qwen3"], "attention_bias": False})
        model = save_tiny_family("qwen3", tmp_path / "qwen3", draft_dir)
    else:
        model = draft_dir if row == "draft" else family_dir(row)
    scheme = WeightScheme(bits=bits, group_size=32, symmetric=symmetric)
    path = tmp_path / "model.gguf"
    quantize_model(model, path, QuantizeOptions(method=method, format="gguf", weights=scheme, calibration=CALIB))
    kind = ArtifactKind("gguf", bits, symmetric)
    assert matrix.expected_status(kind, matrix.LLAMA_CPP) == "loads"
    tokens = torch.randint(0, read_config(path)["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    llama = LlamaCppModel(path, n_ctx=48)
    got = llama(tokens).logits
    llama.close()
    runtime = load_runtime_model(write_model_dir(path, tmp_path / "reference"))
    with torch.inference_mode():
        want = torch.stack(run_paged(runtime, tokens.tolist(), whole_prefills([48, 48])))
    # llama.cpp multiplies with 8-bit activations: close to optkit's logits, not equal
    assert (got - want).abs().mean().item() < 0.05 * want.std().item()
    label = "draft (llama, trained)" if row == "draft" else f"{row} (tiny, random)"
    versions = {**_versions(), "llama-cpp-python": matrix.installed_version("llama-cpp-python")}
    cell = {"row": label, "method": method, "kind": kind.describe(), "format": "gguf", "versions": versions}
    cell.update(bits=bits, symmetric=symmetric, w8a8=False, type="int")
    record({**cell, "loader": matrix.LLAMA_CPP, "status": "loads"})
    for loader in (matrix.OPTKIT, matrix.TRANSFORMERS, matrix.GPTQMODEL, matrix.VLLM):
        record({**cell, "loader": loader, "status": "no"})
