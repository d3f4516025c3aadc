"""Incremental detokenisation (runtime/detokenizer.py): the text a request gets, token by token, is
the text of all its output tokens decoded at once, on real tokenizers (byte-level BPE, whose tokens
split UTF-8 characters, and SentencePiece's metaspace, whose decoding drops a leading space), and a
long output's steps decode a few tokens each, not all of them."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from optkit.runtime.detokenizer import Detokenizer

TEXT = [
    "The café served crème brûlée and naïve piñatas — 東京 and 北京 ☕ 🚀🚀 at 12:30.",
    "Über straße ÆØÅ æøå ñ ç ğ ş ı İ Ω≈ç√∫ ˜µ≤≥÷ 😀😃😄 ½ ¾ ₤ € ¥",
    "plain ascii words, punctuation! and    spaces\tand\nnewlines.",
]


def byte_level() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT * 5, trainer)
    return tokenizer


def metaspace() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *bytes_])
    tokenizer.train_from_iterator(TEXT * 5, trainer)
    return tokenizer


class Counted:
    """A tokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def streamed(tokenizer, ids: list[int], stop: list[str] | None = None) -> str:
    detokenizer = Detokenizer(tokenizer, stop)
    text = ""
    for n in range(1, len(ids) + 1):
        detokenizer.watch(ids[:n], finished=n == len(ids))
        text += detokenizer.take()
        if detokenizer.stopped:
            break
    return text


@pytest.mark.parametrize("make", [byte_level, metaspace])
def test_the_streamed_text_is_the_text_of_all_the_tokens(make):
    tokenizer = make()
    for text in TEXT:
        ids = tokenizer.encode(text).ids
        assert streamed(tokenizer, ids) == tokenizer.decode(ids) == text
    rng = random.Random(0)  # token sequences no text produced: split characters, bytes that never join
    for _ in range(300):
        ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 40))]
        assert streamed(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stop_string_cuts_the_streamed_text_as_it_cuts_the_whole():
    tokenizer = byte_level()
    ids = tokenizer.encode(TEXT[0]).ids
    assert streamed(tokenizer, ids, stop=["東京"]) == TEXT[0][: TEXT[0].index("東京")]


def test_a_long_outputs_steps_decode_a_few_tokens_each():
    tokenizer = Counted(byte_level())
    ids = tokenizer.tokenizer.encode(" ".join(TEXT * 20)).ids
    assert streamed(tokenizer, ids) == tokenizer.tokenizer.decode(ids)
    assert tokenizer.decoded < 8 * len(ids)  # all of them at every step: len(ids)² / 2
