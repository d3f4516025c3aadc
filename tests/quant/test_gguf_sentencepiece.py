"""SentencePiece vocabularies (a tokenizer.model: Llama 2, Mistral v0.1, Gemma) in `--format gguf`:
the tokens, scores, types and special ids llama.cpp's converter writes, and llama.cpp's token ids
equal to transformers' (the model directory's own tokenizer) on held-out text and odd inputs, for
BPE and unigram .models trained here (tests/quant/sentencepiece_models.py)."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from sentencepiece import SentencePieceProcessor

from optkit.data.eval_sets import load_text_set
from optkit.errors import OptkitError
from optkit.gate.llama_cpp import LlamaCppModel, llama_cpp_available
from optkit.modeldir import load_tokenizer, read_config
from optkit.quant.formats.gguf_metadata import language_model_config
from optkit.quant.formats.gguf_vocab import add_tokenizer, check_tokenizer
from optkit.quant.quantize import QuantizeOptions, quantize_model
from optkit.weights.schemes import WeightScheme
from tests.quant.sentencepiece_models import save_sentencepiece_family, train_sentencepiece

needs_llama_cpp = pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp: pip install 'optkit[gguf]'")
PADDING = 8  # gemma2's config.json counts 8 ids past its .model (as Gemma 3's multimodal vocab does)
# family -> (the .model's layout, its training)
MODELS = {
    "llama": ("llama", "bpe"),
    "mistral": ("llama", "unigram"),
    "gemma2": ("gemma", "bpe"),
    "gemma3_text": ("gemma", "unigram"),
    "gemma3": ("gemma", "bpe"),  # the language model of Gemma3ForConditionalGeneration (text_config's vocab)
    "phi3": ("llama", "bpe"),  # Phi3MiniModel's own added-token rule
}
ODD_TEXTS = [
    "",
    "x",
    "a  b   c\t\td\n\n\ne",  # whitespace runs inside
    "trailing spaces   \n",
    "naïve café — 3.14159 ≈ π, 日本語, 🦙🦙 and ＡＢＣ",  # unicode, most of it byte fallback
    "\x00\x01\x7f control bytes \ufeff",
    "e\u0301 combining, \u200d joiner",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (model directory, its GGUF as RTN Q8_0)."""
    root = tmp_path_factory.mktemp("sentencepiece")
    protos = {kind: train_sentencepiece(*kind) for kind in set(MODELS.values())}
    made = {}
    for number, (family, kind) in enumerate(MODELS.items()):
        padding = {"vocab_size": len(_pieces(protos[kind])) + PADDING} if family == "gemma2" else {}
        # neutral names: general.name comes from it, and llama.cpp expects Phi-3's tokens of a "phi3" one
        model = save_sentencepiece_family(family, root / f"model-{number}", protos[kind], kind[0], **padding)
        out = root / f"model-{number}.gguf"
        scheme = WeightScheme(bits=8, group_size=32, symmetric=True)
        quantize_model(str(model), out, QuantizeOptions(method="rtn", weights=scheme, format="gguf"))
        made[family] = (model, out)
    return made


def _pieces(proto: bytes) -> list[str]:
    processor = SentencePieceProcessor(model_proto=proto)
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


def _fields(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith("tokenizer.")}


@pytest.mark.parametrize("family", MODELS)
def test_the_vocabulary_is_written_as_llama_cpps_converter_writes_a_tokenizer_model(models, family):
    """_create_vocab_sentencepiece: every piece with its score and type, the special tokens as
    control tokens (score -1000), ids past the .model as [PAD{i}] (-10000, unused); Gemma's
    converters write no space prefix; the ids and add-BOS/EOS are transformers'."""
    model, path = models[family]
    fields = _fields(path)
    processor = SentencePieceProcessor(model_file=str(model / "tokenizer.model"))
    tokenizer = load_tokenizer(model)
    vocab_size = language_model_config(read_config(model))["vocab_size"]
    tokens, scores, types = (fields[f"tokenizer.ggml.{key}"] for key in ("tokens", "scores", "token_type"))
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("llama", "default")
    assert len(tokens) == len(scores) == len(types) == vocab_size
    special = {tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}
    for i in range(processor.get_piece_size()):
        assert tokens[i] == processor.id_to_piece(i), i
        if i in special:
            assert (types[i], scores[i]) == (gguf.TokenType.CONTROL, -1000.0), tokens[i]
        elif processor.is_byte(i):
            assert types[i] == gguf.TokenType.BYTE, tokens[i]
        else:
            assert types[i] == gguf.TokenType.NORMAL and scores[i] == pytest.approx(processor.get_score(i)), tokens[i]
    for i in range(processor.get_piece_size(), vocab_size):
        assert (tokens[i], scores[i], types[i]) == (f"[PAD{i}]", -10000.0, gguf.TokenType.UNUSED)
    assert fields["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert fields["tokenizer.ggml.unknown_token_id"] == tokenizer.unk_token_id
    assert (fields["tokenizer.ggml.add_bos_token"], fields["tokenizer.ggml.add_eos_token"]) == (True, False)
    assert fields.get("tokenizer.ggml.add_space_prefix") == (False if family.startswith("gemma") else None)
    assert "tokenizer.ggml.merges" not in fields


def _texts(family: str) -> list[str]:
    # Llama's: nothing after a special token (llama.cpp prefixes a space there, see below)
    specials = "</s>" if family in ("llama", "mistral", "phi3") else "<bos><start_of_turn>user\nhi<end_of_turn>\n"
    return load_text_set("heldout").texts[:12] + ODD_TEXTS + [f"a{specials}"]


@needs_llama_cpp
@pytest.mark.parametrize("family", MODELS)
def test_llama_cpp_token_ids_are_transformers_ids(models, family):
    """llama.cpp's ids for held-out code and odd text (empty, whitespace runs, unicode and bytes
    without a piece, special-token text) are transformers', with and without BOS."""
    model, path = models[family]
    tokenizer = load_tokenizer(model)
    llama = LlamaCppModel(path, n_ctx=256)
    try:
        for text in _texts(family):
            assert llama.tokenize(text) == tokenizer(text, add_special_tokens=False)["input_ids"], text[:60]
        assert llama.tokenize("def f(x):", add_bos=True) == tokenizer("def f(x):")["input_ids"]
    finally:
        llama.close()


@needs_llama_cpp
def test_where_a_space_prefix_makes_llama_cpp_differ_it_tokenizes_as_sentencepiece(models):
    """Two places transformers 5's Llama tokenizer (Metaspace, prefix on the first piece only)
    and llama.cpp part (docs/quantization.md, GGUF): a text that starts with a space gets one "▁"
    more in llama.cpp, as in SentencePiece itself (a BPE .model: a unigram one SentencePiece
    segments by Viterbi), and text after a special token a prefix."""
    model, path = models["llama"]
    processor = SentencePieceProcessor(model_file=str(model / "tokenizer.model"))
    tokenizer = load_tokenizer(model)
    llama = LlamaCppModel(path, n_ctx=256)
    try:
        for text in (" ", "  two leading spaces", " def f():"):
            assert llama.tokenize(text) == processor.encode(text), text
            assert llama.tokenize(text) != tokenizer(text, add_special_tokens=False)["input_ids"], text
        assert llama.tokenize("</s>hello") == [tokenizer.eos_token_id, *processor.encode("hello")]
    finally:
        llama.close()


def _copy(model, tmp_path):
    import shutil

    return shutil.copytree(model, tmp_path / "model")


def test_a_tokenizer_model_that_normalizes_text_is_refused_in_one_line(models, tmp_path, run_cli):
    """llama.cpp does not fold characters (NFKC) or collapse spaces: such a .model would tokenize
    other text in llama.cpp than in transformers; refused before anything is quantized."""
    model = _copy(models["llama"][0], tmp_path)
    (model / "tokenizer.model").write_bytes(train_sentencepiece("llama", "bpe", normalizer="nmt_nfkc"))
    out = tmp_path / "model.gguf"
    code, _, err = run_cli(
        "quantize", model, "--format", "gguf", "--bits", "8", "--sym", "--group-size", "32", "--out", out
    )
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "normalizer changes text" in errors[0], err
    assert "tokenizer.model" in errors[0] and not out.exists()


def _has_protobuf() -> bool:
    try:
        import google.protobuf  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_has_protobuf(), reason="with protobuf transformers reads the .model alone")
def test_a_tokenizer_model_without_its_tokenizer_json_is_one_line(models, tmp_path, run_cli):
    """transformers converts a tokenizer.model alone only with protobuf: without it, one line."""
    model = _copy(models["gemma2"][0], tmp_path)
    (model / "tokenizer.json").unlink()
    code, _, err = run_cli("quantize", model, "--format", "gguf", "--bits", "8", "--sym", "--group-size", "32",
                           "--out", tmp_path / "model.gguf")  # fmt: skip
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "pip install protobuf" in errors[0], err


@pytest.mark.parametrize("damage", ["not a protobuf", "a piece that is not UTF-8"])
def test_a_broken_tokenizer_model_is_one_line(models, tmp_path, damage):
    model = _copy(models["gemma2"][0], tmp_path)
    proto = (model / "tokenizer.model").read_bytes()
    if damage == "not a protobuf":
        proto = b"\x0a\xff\xff not a protobuf"
    else:  # sentencepiece loads it; reading the piece fails
        assert b"<end_of_turn>" in proto
        proto = proto.replace(b"<end_of_turn>", b"<end_of_tur\xff>")
    (model / "tokenizer.model").write_bytes(proto)
    with pytest.raises(OptkitError, match="tokenizer.model is not a SentencePiece model"):
        check_tokenizer(model, read_config(model))


def _converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py of the llama.cpp the `gguf` extra links, where
    bench/build_llama_cpp_tools.sh unpacked its sources."""
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None
    script = Path(__file__).parents[2] / ".cache" / "llama.cpp-tools" / f"src-{version}" / "convert_hf_to_gguf.py"
    return script if script.is_file() else None


def _as_transformers_4_saved(model: Path, out: Path, **settings) -> Path:
    """The directory as transformers 4 saved it: tokenizer_config.json lists the added tokens
    (added_tokens_decoder) and the add-BOS/EOS flags, as Llama 2's and Gemma's on the Hub do
    (and `settings`)."""
    import shutil

    shutil.copytree(model, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config.update(add_bos_token=True, add_eos_token=False, **settings)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _vocabulary_file(model: Path, out: Path) -> Path:
    """optkit's vocabulary of `model` alone in a GGUF file (the metadata add_tokenizer writes)."""
    config = read_config(model)
    writer = gguf.GGUFWriter(out, "llama")
    add_tokenizer(writer, model, config)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return out


@pytest.mark.slow
@pytest.mark.skipif(_converter() is None, reason="llama.cpp's sources: bench/build_llama_cpp_tools.sh")
@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_the_vocabulary_is_the_converters_own(models, tmp_path, family):
    """Against llama.cpp's convert_hf_to_gguf.py --vocab-only itself, on the directory as the Hub
    holds such models: every tokenizer key and value the same, in the same order, but add_sep_token,
    which optkit leaves out (transformers adds no separator to one text)."""
    # Llama's set_vocab writes tokenizer_config.json's add_prefix_space where it is set
    settings = {"add_prefix_space": True} if family == "llama" else {}
    model = _as_transformers_4_saved(models[family][0], tmp_path / "model", **settings)
    converted = tmp_path / "converted.gguf"
    command = [sys.executable, str(_converter()), str(model), "--vocab-only", "--outfile", str(converted)]
    subprocess.run(command, check=True, capture_output=True)
    theirs, ours = _fields(converted), _fields(_vocabulary_file(model, tmp_path / "optkit.gguf"))
    assert theirs.pop("tokenizer.ggml.add_sep_token") is False
    assert ours == theirs and list(ours) == list(theirs)  # the values, and the keys in the converter's order
