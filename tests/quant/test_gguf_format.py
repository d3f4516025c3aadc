"""`--format gguf` without llama.cpp: the file holds exactly the weights the methods chose, in the
block type the scheme names, with the metadata llama.cpp's converter writes for each family."""

import json

import gguf
import pytest
import torch

from optkit.errors import OptkitError
from optkit.families import gguf_architectures
from optkit.modeldir import BUNDLED_DIR, read_tensors
from optkit.quant.formats import gguf as gguf_format
from optkit.quant.formats.gguf_plan import gguf_name
from optkit.quant.formats.gguf_read import read_file, write_model_dir
from optkit.quant.methods.rtn.math import rtn_quantize
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.tiny_families import FAMILIES, save_tiny_family

SMALL_DIR = BUNDLED_DIR / "small"
TYPES = {"Q4_0": (4, True), "Q4_1": (4, False), "Q8_0": (8, True)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    models = {name: save_tiny_family(name, root / name, SMALL_DIR) for name in ("llama", "mistral", "qwen2", "qwen3")}
    models["qwen3-biases"] = models.pop("qwen3")
    biased = FAMILIES["qwen3"]
    FAMILIES["qwen3"] = {**biased, "attention_bias": False}  # as Qwen3 ships (llama.cpp has no place for them)
    try:
        models["qwen3"] = save_tiny_family("qwen3", root / "qwen3-no-biases", SMALL_DIR)
    finally:
        FAMILIES["qwen3"] = biased
    return models


def _quantize(model, out, bits=4, sym=True, method="rtn"):
    scheme = WeightScheme(bits=bits, group_size=32, symmetric=sym)
    calibration = {"num_samples": 8, "seq_len": 64}
    options = QuantizeOptions(method=method, weights=scheme, format="gguf", calibration=calibration)
    return quantize_model(model, out, options)


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_holds_exactly_the_rtn_weights_in_the_schemes_block_type(tiny, tmp_path, qtype):
    bits, sym = TYPES[qtype]
    out = tmp_path / "m.gguf"
    _quantize(tiny["llama"], out, bits, sym)
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["blk.1.ffn_down.weight"] == qtype
    assert types["token_embd.weight"] == "F32" and types["blk.0.attn_norm.weight"] == "F32"
    assert reader.fields["general.file_type"].contents() == gguf_format.FILE_TYPES[qtype]
    base = read_tensors(tiny["llama"])
    _, state = read_file(out)
    assert set(state) == set(base)
    stored = gguf_format.constrain(WeightScheme(bits=bits, group_size=32, symmetric=sym))
    for key, weight in base.items():
        if key.endswith("_proj.weight"):  # q/k rows went through Llama's permutation and back
            assert torch.equal(state[key], rtn_quantize(weight, stored).dequantize()), key
        else:
            assert torch.equal(state[key], weight.float()), key
    assert not list(tmp_path.glob(".*")), "the staging directory and temporary file are gone"


def test_the_gguf_is_written_through_a_new_temporary_never_a_link_planted_beside_it(tiny, tmp_path):
    import os

    victim = tmp_path / "victim.txt"
    victim.write_text("not optkit's")
    out = tmp_path / "out" / "m.gguf"
    out.parent.mkdir()
    (out.parent / f".{out.name}.tmp-{os.getpid()}").symlink_to(victim)  # the name the writer used to take
    previous = os.umask(0o022)
    try:
        _quantize(tiny["llama"], out)
    finally:
        os.umask(previous)
    assert victim.read_text() == "not optkit's"
    assert out.stat().st_mode & 0o777 == 0o644  # shared like every artifact, not mkstemp's 600


def test_a_qwen3_with_attention_biases_llama_cpp_cannot_load_is_refused(tiny, tmp_path):
    with pytest.raises(OptkitError, match="Qwen3 has no attention biases"):
        _quantize(tiny["qwen3-biases"], tmp_path / "qwen3.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("family,arch", [("mistral", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_each_family_is_written_as_llama_cpps_converter_names_it(tiny, tmp_path, family, arch):
    out = tmp_path / f"{family}.gguf"
    _quantize(tiny[family], out)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == arch
    names = {t.name for t in reader.tensors}
    expected_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], 2)
    written = gguf_architectures()[family]
    for key in read_tensors(tiny[family]):  # optkit's names agree with gguf-py's own table
        if key == "lm_head.weight" and family == "qwen2":
            continue  # tied: llama.cpp reads token_embd
        stem, _, suffix = key.rpartition(".")
        assert gguf_name(key, written) == f"{expected_map.get_name(stem)}.{suffix}" and gguf_name(key, written) in names
    fields = reader.fields
    assert fields[f"{arch}.attention.head_count_kv"].contents() == 2
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert (f"{arch}.vocab_size" in fields) == (arch == "llama")  # LlamaModel adds it, Qwen2Model does not
    config, state = read_file(out)
    runtime_dir = write_model_dir(out, tmp_path / "back")
    assert json.loads((runtime_dir / "config.json").read_text())["model_type"] == config["model_type"]
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in state and "model.layers.0.self_attn.q_proj.bias" not in state
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in state


def test_tokenizer_and_chat_template_are_written_as_the_converter_does(tmp_path):
    model = tmp_path / "chat"
    save_tiny_family("llama", model, SMALL_DIR)
    template = "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    out = tmp_path / "chat.gguf"
    _quantize(model, out)
    fields = gguf.GGUFReader(out).fields
    vocab = json.loads((SMALL_DIR / "tokenizer.json").read_text())
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 4096 and all(tokens[i] == t for t, i in vocab["model"]["vocab"].items())
    assert len(fields["tokenizer.ggml.merges"].contents()) == len(vocab["model"]["merges"])
    assert fields["tokenizer.ggml.token_type"].contents()[0] == gguf.TokenType.CONTROL  # <|endoftext|>
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert fields["tokenizer.ggml.eos_token_id"].contents() == 0
    assert fields["tokenizer.ggml.add_bos_token"].contents() is False  # transformers adds none either
    assert fields["tokenizer.chat_template"].contents() == template


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--group-size", "128"], "use --group-size 32"),
        (["--group-size", "256"], "or for a K-quant mix such as Q4_K_M --gguf-type Q4_K_M"),
        (["--bits", "8", "--asym"], "Q8_0) are symmetric: use --sym"),
        (["--bits", "3"], "no 3-bit block type"),
        (["--method", "gptq", "--act-order", "--no-static-groups"], "with --act-order add --static-groups"),
        (["--out-name", "model"], "writes one file: give --out NAME.gguf"),
    ],
)
def test_what_gguf_cannot_hold_is_refused_in_one_line_before_any_work(run_cli, tmp_path, flags, message):
    out = tmp_path / ("model" if "--out-name" in flags else "m.gguf")
    flags = [f for f in flags if f not in ("--out-name", "model")]
    code, _, err = run_cli("quantize", "small", "--format", "gguf", "--group-size", "32", *flags, "--out", out)
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert not list(tmp_path.iterdir())


def test_gptq_left_unset_takes_gguf_q4_0_defaults_and_explicit_settings_win():
    """GGUF Q4_0: act-order, static groups, llama.cpp's scale rule; other types and formats the plain ones."""
    q4_0, q4_1 = WeightScheme(bits=4, group_size=32), WeightScheme(bits=4, group_size=32, symmetric=False)
    gptq = QuantizeOptions(method="gptq", format="gguf", weights=q4_0).section("gptq")
    assert (gptq.act_order, gptq.static_groups, gptq.scale) == (True, True, "signed_max")
    plain = (False, False, "minmax")
    for options in (
        QuantizeOptions(method="gptq", format="gguf", weights=q4_1),
        QuantizeOptions(method="gptq", weights=q4_0),
        QuantizeOptions(method="rtn", format="gguf", weights=q4_0),
    ):
        gptq = options.section("gptq")
        assert (gptq.act_order, gptq.static_groups, gptq.scale) == plain
    chosen = QuantizeOptions(method="gptq", format="gguf", weights=q4_0, gptq={"act_order": False, "scale": "minmax"})
    gptq = chosen.section("gptq")
    assert (gptq.act_order, gptq.static_groups, gptq.scale) == (False, True, "minmax")
