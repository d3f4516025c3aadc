"""Tiny SentencePiece vocabularies, trained in seconds on the standard library's sources (the text
the reference models learn from, optkit/data/corpus.py), in the tokenizer files transformers writes
for a tokenizer.model: LlamaTokenizer / GemmaTokenizer built from the .model's pieces and the merges
transformers' SentencePiece extractor derives from them (tokenization_utils_base.generate_merges),
saved beside the .model itself, in the layouts of Llama 2 (<unk> <s> </s>, a space prefix) and
Gemma (<pad> <eos> <bos> <unk> <mask>, no space prefix, turn markers as user-defined pieces)."""

import io
import shutil
from pathlib import Path

from optkit.data.corpus import read_texts
from tests.tiny_families import save_tiny_family

VOCAB = 640
STYLES = {
    "llama": dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True),
    "gemma": dict(
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"],
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
    ),
}
# tokenizer_config.json's special tokens per style (what the real models' files say)
TOKENS = {
    "llama": dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
    "gemma": dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>"),
}


def training_lines(count: int = 6000) -> list[str]:
    """The first `count` non-blank lines of the training split's sources, indentation kept."""
    lines = (line for text in read_texts("train")[:40] for line in text.splitlines() if line.strip())
    return [line for line, _ in zip(lines, range(count), strict=False)]


def train_sentencepiece(style: str, model_type: str = "bpe", normalizer: str = "identity") -> bytes:
    """A byte-fallback SentencePiece model (the .model's bytes), by default identity-normalized as
    Llama 2's and Gemma's are: spaces kept as they are, no Unicode folding."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_lines()),
        model_writer=model,
        vocab_size=VOCAB,
        model_type=model_type,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name=normalizer,
        remove_extra_whitespaces=False,
        character_coverage=0.9995,
        num_threads=1,
        minloglevel=2,
        **STYLES[style],
    )
    return model.getvalue()


def save_tokenizer(proto: bytes, style: str, out: Path) -> Path:
    """The tokenizer files transformers writes for `proto` (and the .model) in `out`."""
    from sentencepiece import SentencePieceProcessor
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer, LlamaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    processor = SentencePieceProcessor(model_proto=proto)
    vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    user_defined = [
        AddedToken(processor.id_to_piece(i), normalized=False, special=True)
        for i in range(processor.get_piece_size())
        if processor.id_to_piece(i) in STYLES[style].get("user_defined_symbols", ())
    ]
    kind = GemmaTokenizer if style == "gemma" else LlamaTokenizer
    tokenizer = kind(vocab=vocab, merges=generate_merges(vocab), add_bos_token=True, **TOKENS[style])
    tokenizer.add_special_tokens({"additional_special_tokens": user_defined})
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    (out / "tokenizer.model").write_bytes(proto)
    return out


def save_sentencepiece_family(family: str, out: Path, proto: bytes, style: str, **overrides) -> Path:
    """A tiny random model of `family` (tests/tiny_families.py) with `proto` as its vocabulary."""
    from sentencepiece import SentencePieceProcessor

    tokenizer_dir = save_tokenizer(proto, style, out.parent / f"{out.name}-tokenizer")
    size = SentencePieceProcessor(model_proto=proto).get_piece_size()
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None} if style == "llama" else {}
    ids = ids or {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    save_tiny_family(family, out, tokenizer_dir, **{"vocab_size": size, **ids, **overrides})
    for file in ("tokenizer.model", "special_tokens_map.json"):
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, out / file)
    return out
