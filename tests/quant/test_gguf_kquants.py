"""`--format gguf` with K-quant tensors on `small` (every width a multiple of 256): the file holds
exactly the weights the method chose, `verify` checks each super-block's scales, GPTQ on the K grid
beats RTN on it layer by layer, and llama.cpp computes on the file what optkit's runtime computes
on its dequantized weights.

A K type is picked here as the format's callers do (formats/gguf.constrain with a type), until the
`--gguf-type` mixes choose one per tensor."""

import json

import gguf
import numpy as np
import pytest
import torch

from optkit.gate.llama_cpp import llama_cpp_available
from optkit.modeldir import BUNDLED_DIR, read_tensors
from optkit.quant.formats import gguf as gguf_format
from optkit.quant.formats.gguf_header import read_header
from optkit.quant.formats.gguf_read import read_file, write_model_dir
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights import kquants
from optkit.weights.schemes import WeightScheme
from tests.compat.test_llama_cpp_column import assert_llama_cpp_agrees, heldout_windows

SMALL = BUNDLED_DIR / "small"
CALIB = {"num_samples": 8, "seq_len": 64}
needs_llama_cpp = pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")


def _quantize(out, qtype: str, method: str):
    scheme = gguf_format.constrain(WeightScheme(bits=4, group_size=32), qtype)
    quantize_model(SMALL, out, QuantizeOptions(method=method, format="gguf", weights=scheme, calibration=CALIB))
    return out


@pytest.fixture(scope="module")
def gptq_q4_k(tmp_path_factory):
    return _quantize(tmp_path_factory.mktemp("gptq-q4k") / "model.gguf", "Q4_K", "gptq")


def _assert_llama_cpp_agrees(path, tmp_path) -> None:
    """llama.cpp's logits on the file against optkit's runtime on the file's dequantized weights, on
    heldout text: the same top token at ≥ 98% of the positions, perplexity within 1% (issue 33)."""
    assert_llama_cpp_agrees(path, heldout_windows(SMALL), write_model_dir(path, tmp_path / "reference"))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", kquants.K_TYPES)
def test_an_rtn_k_quant_file_holds_exactly_rtns_weights_and_llama_cpp_agrees(tmp_path, qtype):
    path = _quantize(tmp_path / "model.gguf", qtype, "rtn")
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.3.ffn_down.weight"] == qtype
    assert reader.fields["general.file_type"].contents() == gguf_format.FILE_TYPES[qtype]
    _, state = read_file(path)
    scheme = gguf_format.constrain(WeightScheme(), qtype)
    for key, weight in read_tensors(SMALL).items():
        if key.endswith("_proj.weight"):
            assert torch.equal(state[key], rtn_quantize(weight, scheme).dequantize()), key
    if llama_cpp_available():
        _assert_llama_cpp_agrees(path, tmp_path)


@pytest.mark.slow
def test_gptq_on_the_k_grid_beats_rtn_on_it_on_every_layer(gptq_q4_k):
    manifest = json.loads(bytes(gguf.GGUFReader(gptq_q4_k).fields["optkit.manifest"].parts[-1]).decode())
    layers = manifest["layers"]
    assert len(layers) == 4 * 7
    for layer in layers:
        assert layer["loss"] < layer["rtn_loss"], layer["name"]


@pytest.mark.slow
@needs_llama_cpp
def test_llama_cpp_computes_on_a_gptq_q4_k_file_what_optkit_computes(gptq_q4_k, tmp_path):
    _assert_llama_cpp_agrees(gptq_q4_k, tmp_path)


@pytest.mark.slow
def test_verify_names_a_super_block_whose_dmin_is_nan(run_cli, gptq_q4_k, tmp_path):
    assert run_cli("verify", gptq_q4_k)[0] == 0
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gptq_q4_k.read_bytes())
    header = read_header(bad)
    target = next(t for t in header.tensors if t.name == "blk.0.attn_v.weight")
    with bad.open("r+b") as f:  # block_q4_K: half d, half dmin, 12 bytes of scales, 128 of levels
        f.seek(header.data_start + target.offset + 144 * 1 + 2)  # the second super-block's dmin
        f.write(np.float16(np.inf).tobytes())
    code, _, err = run_cli("verify", bad)
    assert code == 2 and "tensor blk.0.attn_v.weight (Q4_K): 1 scales are NaN or infinite" in err
