"""The compatibility matrix's llama.cpp column: every GGUF kind optkit writes loads in llama.cpp (and
computes what optkit's runtime computes on the file's weights), for the trained draft model, every
file type on the trained small model (widths of 256: the K-quants apply) and each family llama.cpp
shares with optkit (every family in every type: test_llama_cpp_families.py); no other loader reads
GGUF, and llama.cpp reads nothing else."""

import pytest
import torch

from optkit.compat import matrix
from optkit.data.eval_sets import load_text_set
from optkit.data.packing import pack_windows, tokenize_stream
from optkit.gate.llama_cpp import LlamaCppModel, llama_cpp_available
from optkit.gate.llama_cpp_agreement import PPL_REL, SAME_TOP, llama_cpp_agreement
from optkit.modeldir import load_tokenizer
from optkit.models.loader import load_runtime_model
from optkit.quant.formats.gguf_mix import linear_scheme
from optkit.quant.formats.gguf_read import read_config, write_model_dir
from optkit.quant.formats.kind import ArtifactKind
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.compat.test_matrix import _versions
from tests.models.paged import run_paged, whole_prefills
from tests.tiny_families import FAMILIES, save_tiny_family

KINDS = {"Q4_0": ("gptq", 4, True), "Q4_1": ("awq", 4, False), "Q8_0": ("rtn", 8, True)}
# every --gguf-type that quantizes, on small: RTN, and Q4_K_M (what a llama.cpp user downloads) by GPTQ
FILE_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q3_K_L", "Q3_K_M", "Q3_K_S"]
FILE_TYPES += ["Q2_K"]
K_MIXES = ("Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M")
HELDOUT_WINDOWS, WINDOW = 48, 128
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
    """Every kind on the trained draft model; each family once in each legacy type, and in the K mixes
    a llama.cpp user picks (these tiny models' widths are not multiples of 256: the mixes' fallback
    blocks, Q5_0/Q5_1/Q8_0/Q4_0, come with them)."""
    for qtype in KINDS:
        yield pytest.param("draft", qtype, id=f"draft-{qtype}")
    for row in ("llama", "mistral", "qwen2", "qwen3"):
        for qtype in ("Q8_0", *K_MIXES):
            yield pytest.param(row, qtype, id=f"{row}-{qtype}")


@pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")
@pytest.mark.parametrize(("row", "qtype"), list(_cells()))
def test_gguf_loads_in_llama_cpp_where_the_matrix_says(
    tmp_path, monkeypatch, draft_dir, family_dir, record, row, qtype
):
    if row == "qwen3":  # as Qwen3 ships: llama.cpp has no place for attention biases
        monkeypatch.setitem(FAMILIES, "qwen3", {**FAMILIES["qwen3"], "attention_bias": False})
        model = save_tiny_family("qwen3", tmp_path / "qwen3", draft_dir)
    else:
        model = draft_dir if row == "draft" else family_dir(row)
    path = tmp_path / "model.gguf"
    if qtype in K_MIXES:
        method, scheme = "rtn", linear_scheme(qtype)
        scheme = scheme if isinstance(scheme, dict) else scheme.model_dump()
        bits, symmetric, kind_name = scheme["bits"], scheme["symmetric"], f"gguf {qtype}"
        quantize_model(model, path, QuantizeOptions(method=method, format="gguf", gguf={"type": qtype}))
    else:
        method, bits, symmetric = KINDS[qtype]
        scheme = WeightScheme(bits=bits, group_size=32, symmetric=symmetric)
        options = QuantizeOptions(method=method, format="gguf", weights=scheme, calibration=CALIB)
        quantize_model(model, path, options)
        kind = ArtifactKind("gguf", bits, symmetric)
        assert matrix.expected_status(kind, matrix.LLAMA_CPP) == "loads"
        kind_name = f"gguf {qtype}"
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
    cell = {"row": label, "method": method, "kind": kind_name, "format": "gguf", "versions": versions}
    cell.update(bits=bits, symmetric=symmetric, w8a8=False, type="int")
    record({**cell, "loader": matrix.LLAMA_CPP, "status": "loads"})
    for loader in (matrix.OPTKIT, matrix.TRANSFORMERS, matrix.GPTQMODEL, matrix.VLLM):
        record({**cell, "loader": loader, "status": "no"})


def heldout_windows(model_dir, count: int = HELDOUT_WINDOWS, seq_len: int = WINDOW) -> torch.Tensor:
    """The first `count` windows of the heldout eval set, tokenized for `model_dir`: [count, seq_len]."""
    return pack_windows(tokenize_stream(load_tokenizer(model_dir), load_text_set("heldout").texts), seq_len, count)


def assert_llama_cpp_agrees(path, tokens: torch.Tensor, reference_dir, n_ctx: int | None = None, first: int = 1):
    """llama.cpp on the .gguf at `path` against optkit's runtime on its weights (`reference_dir`,
    the file's dequantized weights), at the positions that predict tokens[:, first:]: the same top
    token at ≥ 98% of them and a perplexity within 1% (issues 33 and 34: optkit/gate/llama_cpp_agreement.py)."""
    agreement = llama_cpp_agreement(path, tokens, reference_dir, n_ctx, first)
    assert agreement.same_top >= SAME_TOP, agreement.describe()
    assert agreement.ppl_llama_cpp == pytest.approx(agreement.ppl_runtime, rel=PPL_REL), agreement.describe()


@pytest.mark.slow
@pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")
@pytest.mark.parametrize("file_type", FILE_TYPES)
def test_every_file_type_of_small_computes_in_llama_cpp_what_optkit_does(tmp_path, small_dir, record, file_type):
    method = "gptq" if file_type == "Q4_K_M" else "rtn"
    path = tmp_path / "model.gguf"
    options = QuantizeOptions(method=method, format="gguf", gguf={"type": file_type}, calibration=CALIB)
    quantize_model(small_dir, path, options)
    reference = write_model_dir(path, tmp_path / "reference")
    assert_llama_cpp_agrees(path, heldout_windows(small_dir), reference)
    scheme = linear_scheme(file_type)
    scheme = scheme if isinstance(scheme, dict) else scheme.model_dump()
    versions = {**_versions(), "llama-cpp-python": matrix.installed_version("llama-cpp-python")}
    cell = {"row": "small (llama, trained)", "method": method, "kind": f"gguf {file_type}", "format": "gguf"}
    cell.update(versions=versions, bits=scheme["bits"], symmetric=scheme["symmetric"], w8a8=False, type="int")
    record({**cell, "loader": matrix.LLAMA_CPP, "status": "loads"})
    for loader in (matrix.OPTKIT, matrix.TRANSFORMERS, matrix.GPTQMODEL, matrix.VLLM):
        record({**cell, "loader": loader, "status": "no"})
