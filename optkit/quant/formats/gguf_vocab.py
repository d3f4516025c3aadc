"""The vocabulary of a model's GGUF file as llama.cpp's converter writes it: a SentencePiece
tokenizer.model where the architecture's converter reads one (gguf_sentencepiece.py:
`_set_vocab_sentencepiece`, tokenizer.ggml.model "llama"), else a byte-level BPE tokenizer.json
(`_set_vocab_gpt2`, "gpt2", with its pre-tokenizer), then the special token ids, whether BOS/EOS
are added and the chat template. Read from the tokenizer files (JSON and the .model's protobuf;
nothing is executed)."""

import logging
from pathlib import Path

from optkit.errors import OptkitError
from optkit.json_strict import read_object
from optkit.quant.formats import gguf_sentencepiece as spm
from optkit.quant.formats.gguf_metadata import gguf_architecture, language_model_config

# tokenizer.json's pre-tokenizer -> llama.cpp's `tokenizer.ggml.pre` (src/llama-vocab.cpp): the GPT-2
# split is ByteLevel's own regex; Llama 3 and Qwen2 split with these regexes before a plain ByteLevel
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}


def check_tokenizer(model_dir: Path, config: dict) -> None:
    """Before any calibration: one line for a vocabulary llama.cpp would tokenize otherwise."""
    from optkit.modeldir import load_tokenizer

    arch = gguf_architecture(config).name
    if spm.uses_sentencepiece(model_dir, arch):
        spm.check_normalizer(spm.load_model(model_dir), model_dir)
        spm.check_merges(load_tokenizer(model_dir), model_dir)
        return
    tokenizer_json = model_dir / "tokenizer.json"
    if tokenizer_json.is_file():
        pre_tokenizer(read_object(tokenizer_json, "a tokenizer"), tokenizer_json)


def pre_tokenizer(tokenizer_json: dict, where: Path) -> str:
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel":
        regex = steps[0].get("pattern", {}).get("Regex")
        if regex in PRE_TOKENIZERS and not steps[1].get("use_regex", True):
            return PRE_TOKENIZERS[regex]
    raise OptkitError(
        f"{where}: llama.cpp splits text as GPT-2, Llama 3 or Qwen2 byte-level BPE, and this tokenizer's "
        "pre-tokenizer is none of them (a SentencePiece vocabulary is written from its tokenizer.model): "
        "use --format compressed-tensors"
    )


def add_tokenizer(writer, model_dir: Path, config: dict) -> None:
    """The vocabulary, its special tokens and the chat template."""
    from optkit.modeldir import load_tokenizer

    arch = gguf_architecture(config).name
    vocab_size = language_model_config(config)["vocab_size"]
    sentencepiece = spm.uses_sentencepiece(model_dir, arch)
    tokenizer_json = None if sentencepiece else _byte_level_bpe(model_dir)
    tokenizer = load_tokenizer(model_dir)  # never the auto_map code
    if sentencepiece:
        spm.check_merges(tokenizer, model_dir)
        _add_sentencepiece(writer, model_dir, vocab_size, arch)
    else:
        _add_byte_level_bpe(writer, tokenizer_json, model_dir / "tokenizer.json", vocab_size, tokenizer)
    _add_special_tokens(writer, model_dir, vocab_size, tokenizer, merges=not sentencepiece)
    if sentencepiece and spm.RULES[arch].space_prefix is not None:  # Gemma2Model/Gemma3Model.set_vocab, last
        writer.add_add_space_prefix(spm.RULES[arch].space_prefix)


def _add_sentencepiece(writer, model_dir: Path, vocab_size: int, arch: str) -> None:
    """_set_vocab_sentencepiece's vocabulary, after LlamaModel.set_vocab's space prefix where
    tokenizer_config.json sets add_prefix_space."""
    tokens, scores, types = spm.vocabulary(model_dir, vocab_size, arch)
    if spm.RULES[arch].prefix_from_config and (prefix := spm.configured_space_prefix(model_dir)) is not None:
        writer.add_add_space_prefix(prefix)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)


def _byte_level_bpe(model_dir: Path) -> dict:
    """tokenizer.json, once it is a byte-level BPE tokenizer."""
    file = model_dir / "tokenizer.json"
    if not file.is_file():
        raise OptkitError(
            f"{model_dir} has no tokenizer.json (nor a tokenizer.model that llama.cpp's converter reads for this "
            "architecture): --format gguf needs a byte-level BPE tokenizer.json or a SentencePiece tokenizer.model"
        )
    tokenizer_json = read_object(file, "a tokenizer")
    model = tokenizer_json.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("byte_fallback"):
        raise OptkitError(
            f"{file}: --format gguf writes byte-level BPE tokenizers (GPT-2, Llama 3, Qwen) from tokenizer.json and "
            "SentencePiece ones from their tokenizer.model, which this directory lacks: add it, or use "
            "--format compressed-tensors"
        )
    return tokenizer_json


def _add_byte_level_bpe(writer, tokenizer_json: dict, file: Path, vocab_size: int, tokenizer) -> None:
    """A byte-level BPE vocabulary as `_set_vocab_gpt2` writes it: tokens in byte-to-unicode form,
    their types (control for special added tokens); the merges come with the special tokens."""
    import gguf

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer_json, file))
    writer.add_token_list(tokens)
    writer.add_token_types(types)


def _add_special_tokens(writer, model_dir: Path, vocab_size: int, tokenizer, merges: bool) -> None:
    """gguf-py's SpecialVocab (the ids from tokenizer_config.json and config.json, BPE's merges, the
    chat template), with add-BOS/EOS as transformers' tokenizer does it."""
    import gguf

    log = logging.getLogger("gguf.vocab")
    log.addFilter(_not_template_notes)
    try:
        special = gguf.SpecialVocab(model_dir, load_merges=merges, n_vocab=vocab_size)
    finally:
        log.removeFilter(_not_template_notes)
    # what transformers does when asked to add special tokens, whatever the files' flags say
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    special.add_special_token["bos"] = len(with_special) > len(plain) and with_special[0] == tokenizer.bos_token_id
    special.add_special_token["eos"] = len(with_special) > len(plain) and with_special[-1] == tokenizer.eos_token_id
    special.add_special_token.pop("sep", None)
    if special.chat_template is None and getattr(tokenizer, "chat_template", None):
        special.chat_template = tokenizer.chat_template
    special.add_to_gguf(writer, quiet=True)


def _not_template_notes(record: logging.LogRecord) -> bool:
    """gguf-py's notes on a post-processor's pair template (Llama's "<s> $A <s> $B"), which the
    file never uses: dropped, its other warnings (a special id out of range) kept."""
    return "TemplateProcessing" not in record.getMessage()
