"""`--gguf-type`: llama.cpp's file types written by optkit. F16/BF16/F32 hold the model as it is (llama.cpp
runs them as optkit's runtime runs the base model); a quantized type holds the tensors llama-quantize
would give each type, with `general.file_type` and the manifest's layer records saying which."""

import json
from collections import Counter

import gguf
import pytest
import torch

from optkit.gate.llama_cpp import LlamaCppModel, llama_cpp_available
from optkit.models.loader import load_runtime_model
from optkit.quant.formats.gguf_mix import linear_scheme
from tests.cli.test_bad_input import assert_user_error
from tests.models.paged import run_paged, whole_prefills
from tests.quant.test_gguf_mix import _llama_quantize, _stored_types

needs_llama_cpp = pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")
FULL_PRECISION = {"F32": 0, "F16": 1, "BF16": 32}  # LLAMA_FTYPE_ALL_F32, _MOSTLY_F16, _MOSTLY_BF16


def _written(run_cli, out, *args):
    code, stdout, stderr = run_cli("quantize", *args, "--out", out)
    assert code == 0, stderr
    return stdout


@needs_llama_cpp
@pytest.mark.parametrize("file_type", FULL_PRECISION)
def test_a_full_precision_file_runs_in_llama_cpp_as_the_base_model_runs_in_optkit(run_cli, tmp_path, file_type):
    out = tmp_path / f"{file_type}.gguf"
    assert "no linear quantized" in _written(run_cli, out, "small", "--gguf-type", file_type)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == FULL_PRECISION[file_type]
    types = {t.name: (t.tensor_type.name, len(t.shape)) for t in reader.tensors}
    assert {kind for kind, dims in types.values() if dims == 2} == {file_type}
    assert {kind for kind, dims in types.values() if dims == 1} == {"F32"}  # norms, as the converter writes them
    manifest = json.loads(reader.fields["optkit.manifest"].contents())
    assert manifest["layers"] == [] and manifest["options"]["gguf"] == {"type": file_type}

    windows = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    llama = LlamaCppModel(out, n_ctx=64)
    llama_logits = llama(windows).logits
    llama.close()
    with torch.inference_mode():
        base_logits = torch.stack(run_paged(load_runtime_model("small"), windows.tolist(), whole_prefills([64, 64])))
    assert (llama_logits.argmax(-1) == base_logits.argmax(-1)).double().mean() >= 0.98
    assert (llama_logits - base_logits).abs().mean() < 0.02 * base_logits.std()


@pytest.fixture(scope="module")
def f16_files(tmp_path_factory):
    from optkit.quant.quantize import QuantizeOptions, quantize_model

    root = tmp_path_factory.mktemp("f16")
    files = {model: root / f"{model}.gguf" for model in ("small", "draft")}
    for model, out in files.items():
        quantize_model(model, out, QuantizeOptions(format="gguf", gguf={"type": "F16"}))
    return files


# small: the output (tied embeddings) in Q6_K; draft (rows of 128): in Q8_0, the output's fallback
LEGACY = [("small", "Q8_0"), ("small", "Q4_0"), ("draft", "Q8_0"), ("draft", "Q4_0"), ("draft", "Q4_1")]
# the K mixes optkit writes, on small (rows of 256 and 768; draft's fallbacks: tests/quant/test_gguf_mix.py):
# uniform ones, and those that raise attn_v, ffn_down or attn_output of some layers above the default
K_MIXES = [pytest.param("small", t, marks=pytest.mark.slow) for t in ("Q6_K", "Q5_K_S", "Q3_K_S")]
K_MIXES += [pytest.param("small", t, marks=pytest.mark.slow) for t in ("Q4_K_M", "Q5_K_M", "Q3_K_M")]


@needs_llama_cpp
@pytest.mark.parametrize("model, file_type", LEGACY + K_MIXES)
def test_optkits_file_holds_the_tensor_types_llama_quantize_writes(run_cli, tmp_path, f16_files, model, file_type):
    theirs = _stored_types(_llama_quantize(f16_files[model], tmp_path / "theirs.gguf", file_type))
    ours = tmp_path / "ours.gguf"
    _written(run_cli, ours, model, "--gguf-type", file_type)
    assert _stored_types(ours) == theirs
    reader = gguf.GGUFReader(ours)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType[f"MOSTLY_{file_type}"]
    manifest = json.loads(reader.fields["optkit.manifest"].contents())
    linears = [kind for name, kind in theirs.items() if name.startswith("blk.") and kind != "F32"]  # not norms
    assert Counter(layer["gguf_type"] for layer in manifest["layers"]) == Counter(linears)
    assert manifest["options"]["gguf"] == {"type": file_type}
    default = linear_scheme(file_type)  # the mix's default type's scheme (a legacy one's as a dict)
    default = default if isinstance(default, dict) else default.model_dump()
    assert {key: manifest["options"]["weights"][key] for key in ("bits", "group_size", "symmetric")} == {
        key: default[key] for key in ("bits", "group_size", "symmetric")
    }
    code, stdout, _ = run_cli("inspect", ours, "--json")
    assert code == 0
    shown = {row["type"]: row["tensors"] for row in json.loads(stdout)["types"]}
    assert shown == dict(Counter(theirs.values()))


@pytest.mark.parametrize(
    "flags, fragments",
    [
        (["--gguf-type", "Q4_0", "--bits", "8"], ["Q4_0 4-bit blocks", "drop --bits"]),
        (["--gguf-type", "Q8_0", "--group-size", "128"], ["blocks of 32", "drop --group-size"]),
        (["--gguf-type", "Q8_0", "--asym"], ["Q8_0 is symmetric", "drop --asym"]),
        (["--gguf-type", "F16", "--bits", "4"], ["F16 quantizes no linear", "drop --bits"]),
        (["--gguf-type", "Q8_0", "--format", "gptq"], ["writes a .gguf", "--format gguf"]),
        (["--gguf-type", "Q4_K_X"], ["--gguf-type 'Q4_K_X'", "Q4_K_M"]),
        (["--gguf-type", "Q6_K", "--bits", "4"], ["Q6_K stores Q6_K's super-blocks", "drop --bits"]),
        (["--gguf-type", "Q4_K_M", "--group-size", "128"], ["Q4_K_M stores Q4_K's super-blocks", "drop --group-size"]),
        (["--gguf-type", "Q8_0", "--method", "w8a8"], ["w8a8"]),
    ],
)
def test_a_gguf_type_the_other_flags_contradict_is_one_line(run_cli, tmp_path, flags, fragments):
    assert_user_error(run_cli("quantize", "draft", *flags, "--out", tmp_path / "m.gguf"), *fragments)
    assert not list(tmp_path.iterdir())


def test_a_recipes_gguf_type_needs_the_gguf_format():
    from optkit.quant.quantize import QuantizeOptions

    with pytest.raises(ValueError, match="gguf.type Q8_0 is a GGUF file type: set format gguf"):
        QuantizeOptions(gguf={"type": "Q8_0"})
    with pytest.raises(ValueError, match="gguf.type Q4_0 stores 4-bit blocks of 32, symmetric"):
        QuantizeOptions(format="gguf", gguf={"type": "Q4_0"}, weights={"bits": 4, "group_size": 32, "symmetric": False})
    options = QuantizeOptions(format="gguf", gguf={"type": "Q4_1"})
    assert (options.weights.bits, options.weights.group_size, options.weights.symmetric) == (4, 32, False)
    assert QuantizeOptions(format="gguf", gguf={"type": "BF16"}).ignore == ["*"]
    assert "gguf" not in QuantizeOptions().model_dump()  # the manifests of other formats are as they were


def test_a_recipes_gguf_section_is_read_and_its_mistakes_named():
    from optkit.errors import OptkitError
    from optkit.pipeline.recipe import parse_recipe

    recipe = {"model": "draft", "quantize": {"format": "gguf", "gguf": {"type": "F16"}}, "output": "release"}
    assert parse_recipe(recipe, "r.yaml").quantize.gguf.type == "F16"
    with pytest.raises(OptkitError, match=r"quantize.gguf.type': 'Q5' is not a GGUF file type .* Q4_K_M"):
        parse_recipe({**recipe, "quantize": {"format": "gguf", "gguf": {"type": "Q5"}}}, "r.yaml")
    with pytest.raises(OptkitError, match=r"quantize.gguf.type': Input should be a valid string"):
        parse_recipe({**recipe, "quantize": {"format": "gguf", "gguf": {"type": ["Q4_K_M"]}}}, "r.yaml")


def test_every_linear_ignored_writes_the_file_and_says_so(run_cli, tmp_path):
    """The documented full-precision GGUF of before `--gguf-type` (it wrote the file, then the summary
    divided by zero layers: exit 3)."""
    out = tmp_path / "f.gguf"
    stdout = _written(run_cli, out, "draft", "--ignore", "*", "--format", "gguf", "--group-size", "32")
    assert "no linear quantized: full precision" in stdout
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "BF16"  # as draft stores them


def _file_linears(path, config: dict) -> tuple[dict, dict[str, tuple[str, torch.Tensor]]]:
    """The manifest of an optkit .gguf of the model of `config` and, per quantized linear (checkpoint
    name), its stored type and its weight as llama.cpp reads it (gguf-py's dequantization; q and k
    rows back from GGML's RoPE order)."""
    from gguf.quants import dequantize

    from optkit.quant.formats.gguf_metadata import gguf_architecture, qk_heads, unpermute_qk
    from optkit.quant.formats.gguf_plan import gguf_name

    reader = gguf.GGUFReader(path)
    manifest = json.loads(reader.fields["optkit.manifest"].contents())
    arch = gguf_architecture(config)
    tensors = {t.name: t for t in reader.tensors}
    linears = {}
    for layer in manifest["layers"]:
        stored = tensors[gguf_name(f"{layer['name']}.weight", arch)]
        weight = torch.from_numpy(dequantize(stored.data, stored.tensor_type).copy()).reshape(layer["shape"])
        heads = qk_heads(config, f"{layer['name']}.weight")
        linears[layer["name"]] = (stored.tensor_type.name, weight if heads is None else unpermute_qk(weight, heads))
    return manifest, linears


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_each_linear_of_a_k_mix_holds_the_weight_its_method_chose_on_its_own_type(tmp_path, method):
    """Q4_K_M on small: layers 2 and 3 (use_more_bits of 4) have attn_v and ffn_down in Q6_K, the
    rest Q4_K; each is written in that type, quantized onto that type's grid by the method."""
    from optkit.modeldir import TensorReader, read_config, resolve_model_dir
    from optkit.quant.methods.rtn.math import rtn_quantize, weight_error
    from optkit.quant.quantize import QuantizeOptions, quantize_model
    from optkit.weights.stored import k_scheme

    out = tmp_path / "m.gguf"
    light = {"awq": {"grid": 4, "duo_scaling": "off", "clip_steps": 4, "search_samples": 4}} if method == "awq" else {}
    calibration = {"num_samples": 4, "seq_len": 64}
    options = {"method": method, "format": "gguf", "gguf": {"type": "Q4_K_M"}, "calibration": calibration, **light}
    quantize_model("small", out, QuantizeOptions.model_validate(options))
    manifest, linears = _file_linears(out, read_config(resolve_model_dir("small")))
    raised = {f"model.layers.{i}.{n}" for i in (2, 3) for n in ("self_attn.v_proj", "mlp.down_proj")}
    assert {name for name, (kind, _) in linears.items() if kind == "Q6_K"} == raised
    assert {kind for name, (kind, _) in linears.items() if name not in raised} == {"Q4_K"}
    base = TensorReader(resolve_model_dir("small"))
    for layer in manifest["layers"]:
        kind, stored = linears[layer["name"]]
        assert layer["gguf_type"] == kind and torch.isfinite(stored).all()
        weight = base.get(f"{layer['name']}.weight").float()
        if method == "rtn":
            assert torch.equal(stored, rtn_quantize(weight, k_scheme(kind)).dequantize()), layer["name"]
        if method != "awq":  # AWQ's own error is against its scaled, clipped weight
            error = weight_error(weight, stored)["rel_error"]
            assert error == pytest.approx(layer["rel_error"], rel=1e-4), layer["name"]
