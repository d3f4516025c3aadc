"""A SentencePiece vocabulary (tokenizer.model: Llama 2, Mistral v0.1, Gemma, Phi-3) as llama.cpp's
converter writes it: TextModel._create_vocab_sentencepiece (conversion/base.py), the pieces with their
scores and types, each added token over its id, `[PAD{i}]` up to config.json's vocab_size; and, per
architecture, whether the converter reads tokenizer.model at all and which space prefix it writes
(LlamaModel, Qwen2Model, Gemma2Model/Gemma3Model and Phi3MiniModel's set_vocab).

The .model is a protobuf that sentencepiece's own parser reads (data, nothing is executed).
llama.cpp's tokenizer for it (llm_tokenizer_spm, src/llama-vocab.cpp) only turns spaces into "▁" and
adds the space prefix, then merges pieces by score; a .model that normalizes text otherwise, or a
tokenizer transformers runs as Unigram, would give other ids than transformers': refused."""

from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from optkit.errors import OptkitError
from optkit.json_strict import read_object

MODEL_FILE = "tokenizer.model"
SPACE = "\u2581"  # SentencePiece's "▁"
PAD_SCORE, ADDED_SCORE = -10000.0, -1000.0


class TokenType(IntEnum):
    """gguf.TokenType's values (SentencePieceTokenTypes in the converter)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class SentencePieceRule:
    """How one architecture's converter class writes a tokenizer.model. space_prefix: the
    `tokenizer.ggml.add_space_prefix` it writes (None: none, so llama.cpp prefixes a space);
    prefix_from_config: LlamaModel's, tokenizer_config.json's add_prefix_space where it sets one;
    phi3_added: Phi3MiniModel's added tokens (user-defined unless special, as written)."""

    space_prefix: bool | None = None
    prefix_from_config: bool = False
    phi3_added: bool = False


# llama.cpp architecture -> its converter's rule when the model directory has a tokenizer.model
# (the others' set_vocab is _set_vocab_gpt2: OLMo 2, Qwen2-MoE, Qwen3-MoE)
RULES = {
    "llama": SentencePieceRule(prefix_from_config=True),  # LlamaModel: Llama, Mistral, Mixtral
    "granite": SentencePieceRule(prefix_from_config=True),  # GraniteModel(LlamaModel)
    "qwen2": SentencePieceRule(),
    "qwen3": SentencePieceRule(),
    "gemma2": SentencePieceRule(space_prefix=False),
    "gemma3": SentencePieceRule(space_prefix=False),
    "phi3": SentencePieceRule(phi3_added=True),
}


def uses_sentencepiece(model_dir: Path, arch: str) -> bool:
    """Whether the converter writes this directory's vocabulary from its tokenizer.model."""
    return arch in RULES and (model_dir / MODEL_FILE).is_file()


def configured_space_prefix(model_dir: Path) -> bool | None:
    """tokenizer_config.json's add_prefix_space, which LlamaModel.set_vocab writes where it is set."""
    value = _tokenizer_config(model_dir).get("add_prefix_space")
    return value if isinstance(value, bool) else None


def load_model(model_dir: Path):
    """The directory's tokenizer.model, read by sentencepiece."""
    from sentencepiece import SentencePieceProcessor

    file = model_dir / MODEL_FILE
    processor = SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(file.read_bytes())
        for i in range(processor.get_piece_size()):  # every piece is text (sentencepiece checks no UTF-8)
            processor.id_to_piece(i)
    except (OSError, RuntimeError, UnicodeDecodeError) as e:
        raise OptkitError(f"{file} is not a SentencePiece model ({e}): repair or remove it") from e
    return processor


def check_merges(tokenizer, model_dir: Path) -> None:
    """llama.cpp merges a SentencePiece vocabulary's pieces by score, as transformers' BPE does with
    the merges it derives from them (LlamaTokenizer, GemmaTokenizer: a unigram .model too); a
    tokenizer transformers runs as Unigram (Viterbi over the pieces) gives other ids."""
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    if model is not None and type(model).__name__ != "BPE":
        raise OptkitError(
            f"{model_dir}: transformers tokenizes this SentencePiece vocabulary as {type(model).__name__}, "
            "llama.cpp merges its pieces as BPE does, so token ids would differ: use --format compressed-tensors"
        )


def check_normalizer(processor, model_dir: Path) -> None:
    """llama.cpp passes text as it is (spaces as "▁", after the space prefix its add_space_prefix
    says): a .model whose normalizer folds characters (NFKC) or collapses spaces tokenizes other
    text. (Whether a prefix is added is transformers' tokenizer's to say, as the tests check.)"""
    probe = "  a  b\tc\n\uff21\u00e9e\u0301 "  # runs of spaces, a full-width letter, combining marks
    body = probe.replace(" ", SPACE)
    if processor.normalize(probe) not in (body, SPACE + body):
        raise OptkitError(
            f"{model_dir / MODEL_FILE}: its normalizer changes text (folds characters or collapses spaces) where "
            "llama.cpp's SentencePiece tokenizer does not, so token ids would differ: use --format compressed-tensors"
        )


def vocabulary(model_dir: Path, vocab_size: int, arch: str) -> tuple[list[bytes], list[float], list[int]]:
    """(tokens, scores, token types), `vocab_size` of each, as _create_vocab_sentencepiece builds them."""
    processor = load_model(model_dir)
    check_normalizer(processor, model_dir)
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [PAD_SCORE] * vocab_size
    types = [int(TokenType.UNUSED)] * vocab_size
    for i in range(min(processor.get_piece_size(), vocab_size)):  # ids past vocab_size: ignored, as there
        tokens[i], scores[i] = processor.id_to_piece(i).encode(), processor.get_score(i)
        types[i] = _piece_type(processor, i)
    for i, content, kind in added_tokens(model_dir, RULES[arch].phi3_added):
        if i < vocab_size:
            tokens[i], scores[i], types[i] = content.encode(), ADDED_SCORE, int(kind)
    return tokens, scores, types


def _piece_type(processor, i: int) -> int:
    for test, kind in (
        (processor.is_unknown, TokenType.UNKNOWN),
        (processor.is_control, TokenType.CONTROL),
        (processor.is_unused, TokenType.UNUSED),
        (processor.is_byte, TokenType.BYTE),
    ):
        if test(i):
            return int(kind)
    return int(TokenType.NORMAL)


def added_tokens(model_dir: Path, phi3: bool) -> list[tuple[int, str, TokenType]]:
    """(id, text, type) of the added tokens, in the order the converter writes them over the pieces:
    added_tokens.json (user-defined), then tokenizer_config.json's added_tokens_decoder (control when
    special or looking so, else user-defined with "▁" as a space) and tokenizer.json's added_tokens.
    The converter reads the latter for Phi-3 only (both as control when special, else user-defined,
    as written); others' are read too where tokenizer_config.json does not list them, as transformers
    5 saves them (in tokenizer.json alone), so that they stay special tokens in llama.cpp."""
    entries = []
    file = model_dir / "added_tokens.json"
    if file.is_file():
        for content, i in read_object(file, "added tokens").items():
            entries.append((_token_id(i, file), content, TokenType.USER_DEFINED))
    file = model_dir / "tokenizer_config.json"
    decoder = [(_token_id(key, file), *_added_entry(entry, file)) for key, entry in _decoder(model_dir).items()]
    file = model_dir / "tokenizer.json"
    listed = read_object(file, "a tokenizer").get("added_tokens", []) if file.is_file() else []
    if not isinstance(listed, list):
        raise OptkitError(f"{file}: added_tokens is not a list: repair or re-create it")
    decoded = {i for i, _, _ in decoder}
    for entry in listed:
        i, (content, special) = (
            _token_id(entry.get("id") if isinstance(entry, dict) else None, file),
            _added_entry(entry, file),
        )
        if phi3 or i not in decoded:
            decoder.append((i, content, special))
    for i, content, special in decoder:
        if phi3:
            entries.append((i, content, TokenType.CONTROL if special else TokenType.USER_DEFINED))
        elif special or looks_special(content):
            entries.append((i, content, TokenType.CONTROL))
        else:  # the converter pre-normalizes a user-defined token's spaces
            entries.append((i, content.replace(SPACE, " "), TokenType.USER_DEFINED))
    return entries


def _decoder(model_dir: Path) -> dict:
    decoder = _tokenizer_config(model_dir).get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise OptkitError(f"{model_dir / 'tokenizer_config.json'}: added_tokens_decoder is not an object: repair it")
    return decoder


def looks_special(text: str) -> bool:
    """TextModel.does_token_look_special: added tokens some models leave unmarked that are control tokens."""
    return (
        text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def _tokenizer_config(model_dir: Path) -> dict:
    file = model_dir / "tokenizer_config.json"
    return read_object(file, "tokenizer settings") if file.is_file() else {}


def _token_id(value: object, file: Path) -> int:
    try:
        i = int(value) if isinstance(value, int | str) and not isinstance(value, bool) else None
    except ValueError:
        i = None
    if i is None or i < 0:
        raise OptkitError(f"{file}: added token id {str(value)[:40]!r} is not a token id: repair or re-create it")
    return i


def _added_entry(entry: object, file: Path) -> tuple[str, bool]:
    if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
        raise OptkitError(f"{file}: an added token without a text (content): repair or re-create it")
    return entry["content"], bool(entry.get("special"))
