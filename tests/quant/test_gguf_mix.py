"""llama.cpp's file types: optkit picks, per tensor, the ggml type `llama-quantize` picks for the same
model (llama_model_quantize of the installed llama-cpp-python, run on optkit's full-precision GGUF)."""

from collections import Counter

import gguf
import pytest
import torch

from optkit.gate.llama_cpp import llama_cpp_available
from optkit.quant.formats import gguf_mix
from optkit.quant.formats.gguf_mix import FILE_TYPES, Model, Tensor, tensor_types, use_more_bits
from optkit.quant.quantize import QuantizeOptions, quantize_model

QUANTIZED_MIXES = [name for name, t in FILE_TYPES.items() if t.default not in gguf_mix.FULL_PRECISION]
needs_llama_cpp = pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")


@pytest.fixture(scope="module")
def full_precision(tmp_path_factory):
    """The F16 files llama-quantize starts from: small (rows of 256 and 768), draft (rows of 128 and
    384: every K type falls back), small-moe (4 experts, stacked; rows of 384)."""
    root = tmp_path_factory.mktemp("fp")
    files = {name: root / f"{name}.gguf" for name in ("small", "draft", "small-moe")}
    for name, out in files.items():
        quantize_model(name, out, QuantizeOptions(format="gguf", gguf={"type": "F16"}))
    return files


def _llama_quantize(source, out, mix):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[mix].file_type
    params.nthread = 1
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) == 0
    return out


def _tensors_and_model(path) -> tuple[list[Tensor], Model]:
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def value(key, default=0):
        field = reader.fields.get(f"{arch}.{key}")
        return default if field is None else int(field.contents())

    tensors = [Tensor(t.name, tuple(int(d) for d in t.shape)) for t in reader.tensors]
    model = Model(value("block_count"), value("attention.head_count"), value("attention.head_count_kv"))
    return tensors, Model(**{**model.__dict__, "n_expert": value("expert_count")})


def _stored_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@needs_llama_cpp
@pytest.mark.parametrize("model", ["small", "draft", "small-moe"])
@pytest.mark.parametrize("mix", QUANTIZED_MIXES)
def test_every_tensor_gets_the_type_llama_quantize_gives_it(full_precision, tmp_path, model, mix):
    source = full_precision[model]
    theirs = _stored_types(_llama_quantize(source, tmp_path / "theirs.gguf", mix))
    tensors, hparams = _tensors_and_model(source)
    stored = _stored_types(source)
    ours = {name: qtype or stored[name] for name, qtype in tensor_types(mix, tensors, hparams).items()}
    assert ours == theirs
    assert Counter(ours.values()) == Counter(theirs.values())


def test_a_q4_k_m_mix_raises_attn_v_and_ffn_down_on_the_layers_use_more_bits_names():
    n_layer = 32
    tensors = [Tensor("token_embd.weight", (4096, 32000)), Tensor("output.weight", (4096, 32000))]
    for i in range(n_layer):
        for part, dims in (("attn_v", (4096, 1024)), ("attn_q", (4096, 4096)), ("ffn_down", (11008, 4096))):
            tensors.append(Tensor(f"blk.{i}.{part}.weight", dims))
        tensors.append(Tensor(f"blk.{i}.attn_norm.weight", (4096,)))
    types = tensor_types("Q4_K_M", tensors, Model(n_layer, 32, 8))
    raised = [i for i in range(n_layer) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert raised == [i for i in range(n_layer) if use_more_bits(i, n_layer)]
    assert raised == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert all(types[f"blk.{i}.ffn_down.weight"] == ("Q6_K" if i in raised else "Q4_K") for i in range(n_layer))
    assert {types[f"blk.{i}.attn_q.weight"] for i in range(n_layer)} == {"Q4_K"}
    assert (types["output.weight"], types["token_embd.weight"]) == ("Q6_K", "Q4_K")
    assert types["blk.0.attn_norm.weight"] is None


def test_rows_no_super_block_divides_fall_back_to_a_legacy_type_of_32_columns():
    tensors = [Tensor(f"blk.0.{p}.weight", (288, 64)) for p in ("attn_q", "attn_v", "ffn_down")] + [
        Tensor("token_embd.weight", (288, 100))
    ]
    model = Model(1, 4, 4)
    assert tensor_types("Q4_K_M", tensors, model)["blk.0.attn_q.weight"] == "Q5_0"
    assert tensor_types("Q5_K_S", tensors, model)["blk.0.attn_q.weight"] == "Q5_1"
    assert tensor_types("Q6_K", tensors, model)["blk.0.attn_q.weight"] == "Q8_0"
    assert tensor_types("Q3_K_S", tensors, model)["blk.0.attn_q.weight"] == "Q4_0"
    assert tensor_types("Q4_K_M", tensors, model)["token_embd.weight"] == "Q8_0"  # tied: the output's rule
    assert tensor_types("Q4_K_M", [Tensor("blk.0.attn_q.weight", (300, 64))], model)["blk.0.attn_q.weight"] == "F16"


def test_an_unknown_file_type_lists_those_optkit_writes():
    with pytest.raises(ValueError, match="Q4_K_M"):
        tensor_types("Q4_K_X", [], Model(1, 1, 1))


def test_an_eight_expert_model_keeps_attn_v_and_attn_k_in_q8_0_and_counts_ffn_down_by_block_index():
    tensors = [Tensor("output.weight", (512, 1000))]
    for i in (0, 1):
        tensors += [Tensor(f"blk.{i}.{p}.weight", (512, 512)) for p in ("attn_v", "attn_k", "attn_output")]
    # block 1's experts only: the first ffn_down seen is layer 1 (use_more_bits: the last eighth), not 0
    tensors.append(Tensor("blk.1.ffn_down_exps.weight", (512, 512, 8)))
    types = tensor_types("Q4_K_M", tensors, Model(2, 8, 8, n_expert=8))
    assert {types[f"blk.{i}.attn_v.weight"] for i in (0, 1)} == {types["blk.0.attn_k.weight"]} == {"Q8_0"}
    assert types["blk.1.attn_output.weight"] == "Q5_K"
    assert types["blk.1.ffn_down_exps.weight"] == "Q6_K"
    dense = tensor_types("Q4_K_M", tensors, Model(2, 8, 8))  # counted in order without experts
    assert dense["blk.1.ffn_down_exps.weight"] == "Q4_K"
    with pytest.raises(ValueError, match="block index"):
        tensor_types("Q4_K_M", [Tensor("blk.5.ffn_down_exps.weight", (512, 512, 8))], Model(2, 8, 8, n_expert=8))


def _file_linears(path) -> tuple[dict, dict[str, tuple[str, torch.Tensor]]]:
    """(the manifest, {linear: (its ggml type, its weight as optkit's runtime reads the file)})."""
    import json

    from optkit.quant.formats.gguf_read import read_file

    reader = gguf.GGUFReader(path)
    manifest = json.loads(reader.fields["optkit.manifest"].contents())
    stored = _stored_types(path)
    _, state = read_file(path)
    names = {layer["name"]: layer["name"].split(".")[2:] for layer in manifest["layers"]}
    parts = {"self_attn": "attn", "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "output", "mlp": "ffn"}
    linears = {}
    for name, (block, module, proj) in names.items():
        gguf_name = f"blk.{block}.{parts[module]}_{parts.get(proj, proj.removesuffix('_proj'))}.weight"
        linears[name] = (stored[gguf_name], state[f"{name}.weight"])
    return manifest, linears


# draft's rows of 128 and 384 (256 divides neither): Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q3_K -> Q4_0
FALLBACK_MIXES = ["Q4_K_M", "Q5_K_M", "Q3_K_M", "Q6_K"]


@needs_llama_cpp
@pytest.mark.parametrize("mix", FALLBACK_MIXES)
def test_a_k_mix_of_rows_256_does_not_divide_writes_llama_quantizes_fallback_types(full_precision, tmp_path, mix):
    """optkit's file holds the types llama_model_quantize writes, each linear's type in its layer record,
    each linear's bytes exactly its RTN weight on that type's grid (as optkit's runtime reads the file)."""
    from optkit.modeldir import TensorReader, resolve_model_dir
    from optkit.quant.formats.gguf_check import check_file
    from optkit.quant.formats.gguf_inspect import summary
    from optkit.quant.methods.rtn.math import rtn_quantize

    theirs = _stored_types(_llama_quantize(full_precision["draft"], tmp_path / "theirs.gguf", mix))
    ours = tmp_path / "ours.gguf"
    quantize_model("draft", ours, QuantizeOptions(format="gguf", gguf={"type": mix}))
    assert _stored_types(ours) == theirs
    assert set(theirs.values()) & {"Q5_0", "Q5_1", "Q4_0", "Q8_0"}
    assert check_file(ours).ok  # verify: every block's fp16 scales (and minima) finite
    assert {row["type"]: row["tensors"] for row in summary(ours)["types"]} == dict(Counter(theirs.values()))  # inspect
    manifest, linears = _file_linears(ours)
    assert Counter(kind for kind, _ in linears.values()) == Counter(
        kind for name, kind in theirs.items() if name.startswith("blk.") and kind != "F32"
    )
    base = TensorReader(resolve_model_dir("draft"))
    for layer in manifest["layers"]:
        kind, stored = linears[layer["name"]]
        assert layer["gguf_type"] == kind
        expected = rtn_quantize(base.get(f"{layer['name']}.weight").float(), gguf_mix.block_scheme(kind))
        assert torch.equal(stored, expected.dequantize()), layer["name"]


@needs_llama_cpp
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_methods_write_what_they_optimised_on_the_fallback_blocks(tmp_path, method):
    """Q5_K_M on draft: every linear in Q5_1 (Q5_K's fallback) or Q8_0 (Q6_K's); each layer record's
    error is that of the weight the file holds, and llama.cpp runs the file as optkit's runtime runs
    the same weights (logits within 2% of their spread; a top token differs only at a near-tie)."""
    from optkit.gate.llama_cpp import LlamaCppModel
    from optkit.modeldir import TensorReader, resolve_model_dir
    from optkit.models.loader import load_runtime_model
    from optkit.quant.formats.gguf_read import write_model_dir
    from optkit.quant.methods.rtn.math import weight_error
    from tests.models.paged import run_paged, whole_prefills

    out = tmp_path / "m.gguf"
    light = {"awq": {"grid": 4, "duo_scaling": "off", "clip_steps": 4, "search_samples": 4}} if method == "awq" else {}
    calibration = {"num_samples": 4, "seq_len": 64}
    options = {"method": method, "format": "gguf", "gguf": {"type": "Q5_K_M"}, "calibration": calibration, **light}
    quantize_model("draft", out, QuantizeOptions.model_validate(options))
    manifest, linears = _file_linears(out)
    assert {kind for kind, _ in linears.values()} == {"Q5_1", "Q8_0"}
    base = TensorReader(resolve_model_dir("draft"))
    for layer in manifest["layers"]:
        kind, stored = linears[layer["name"]]
        assert layer["gguf_type"] == kind and torch.isfinite(stored).all()
        if method == "gptq":  # AWQ's own error is against its scaled, clipped weight
            error = weight_error(base.get(f"{layer['name']}.weight").float(), stored)["rel_error"]
            assert error == pytest.approx(layer["rel_error"], rel=1e-4), layer["name"]

    windows = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    llama = LlamaCppModel(out, n_ctx=64)
    llama_logits = llama(windows).logits
    llama.close()
    runtime = load_runtime_model(write_model_dir(out, tmp_path / "dir"))
    with torch.inference_mode():
        ours = torch.stack(run_paged(runtime, windows.tolist(), whole_prefills([64, 64])))
    assert (llama_logits - ours).abs().mean() < 0.02 * ours.std()
    # llama.cpp rounds the activations to 8 bits for its matmuls: on draft's flat logits a near-tie may flip
    picked = ours.gather(-1, llama_logits.argmax(-1, keepdim=True)).squeeze(-1)
    assert (ours.amax(-1) - picked).max() < 0.02 * ours.std()
    assert (llama_logits.argmax(-1) == ours.argmax(-1)).double().mean() >= 0.95


@needs_llama_cpp
def test_optkit_reads_and_verifies_llama_quantizes_iq4_nl_as_gguf_py_dequantizes_it(full_precision, tmp_path):
    """IQ4_NL (the i-quants' fallback): optkit's reader gives each tensor gguf-py's weights, verify passes."""
    import llama_cpp
    import numpy as np

    from optkit.quant.formats.gguf_check import check_file
    from optkit.quant.formats.gguf_metadata import qk_heads, unpermute_qk
    from optkit.quant.formats.gguf_read import read_file

    path = tmp_path / "iq4_nl.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL, 1
    assert llama_cpp.llama_model_quantize(str(full_precision["draft"]).encode(), str(path).encode(), params) == 0
    assert check_file(path).ok
    config, state = read_file(path)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert Counter(t.tensor_type.name for t in tensors.values())["IQ4_NL"] == 14  # draft's 2 × 7 linears
    q_proj = "model.layers.1.self_attn.q_proj.weight"
    for name, hf in (("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"), ("blk.1.attn_q.weight", q_proj)):
        stored = tensors[name]
        assert stored.tensor_type.name == "IQ4_NL"
        weight = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(stored.data, stored.tensor_type)))
        heads = qk_heads(config, hf)
        assert torch.equal(state[hf], weight if heads is None else unpermute_qk(weight, heads))
