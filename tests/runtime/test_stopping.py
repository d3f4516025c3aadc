"""The one stop decision (runtime/stopping.py), without a model: a step's tokens are appended up to
the first that stops the sequence, the reason follows the rules' order, and the text a request gets
ends before its stop string."""

import pytest

from optkit.runtime.detokenizer import Detokenizer
from optkit.runtime.sequence import FinishReason, SamplingParams, Sequence
from optkit.runtime.stopping import StopLimits, append_until_stop

EOS = 0
LIMITS = StopLimits(eos_token_ids=(EOS,), max_model_len=64, max_tokens_held=48)


class Letters:
    """A tokenizer whose token i is the letter chr(ord('a') + i - 1) (0 is EOS, a special token)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t - 1) for t in token_ids if t != EOS)


def letters(text: str) -> list[int]:
    return [ord(c) - ord("a") + 1 for c in text]


def sequence(**params) -> Sequence:
    return Sequence(letters("xyz"), SamplingParams(**{"max_tokens": 16, **params}))


def test_the_tokens_after_the_one_that_stops_are_not_appended():
    seq = sequence()
    assert append_until_stop(seq, [4, EOS, 5, 6], LIMITS) is FinishReason.STOP
    assert seq.output_token_ids == [4, EOS]
    seq = sequence(stop_token_ids=[5])
    assert append_until_stop(seq, [4, 5, 6], LIMITS) is FinishReason.STOP and seq.output_token_ids == [4, 5]
    seq = sequence(ignore_eos=True)
    assert append_until_stop(seq, [4, EOS, 5], LIMITS) is None and seq.output_token_ids == [4, EOS, 5]


@pytest.mark.parametrize(
    ("params", "tokens", "limits", "kept"),
    [
        ({"max_tokens": 2}, [4, 5, 6], LIMITS, 2),
        ({}, [4, 5, 6], StopLimits((EOS,), max_model_len=5, max_tokens_held=48), 2),  # 3 prompt + 2
        ({}, [4, 5, 6], StopLimits((EOS,), max_model_len=64, max_tokens_held=4), 2),  # 5 tokens: over the cache
    ],
)
def test_length_stops_at_the_exact_token(params, tokens, limits, kept):
    seq = sequence(**params)
    assert append_until_stop(seq, tokens, limits) is FinishReason.LENGTH
    assert seq.output_token_ids == tokens[:kept]


def test_a_stop_string_ends_the_output_at_the_token_that_completes_it_and_the_text_before_it():
    seq = sequence(stop=["cd"])
    text = Detokenizer(Letters(), seq.params.stop)
    assert append_until_stop(seq, letters("abcdef"), LIMITS, text) is FinishReason.STOP
    assert seq.output_token_ids == letters("abcd")
    assert text.take() == "ab"


def test_a_stop_string_is_held_back_until_it_is_clear_and_flushed_when_the_output_ends():
    seq = sequence(stop=["cx"], max_tokens=4)
    text = Detokenizer(Letters(), seq.params.stop)
    assert append_until_stop(seq, letters("abc"), LIMITS, text) is None
    assert text.take() == "ab"  # "c" may begin "cx"
    assert append_until_stop(seq, letters("c"), LIMITS, text) is FinishReason.LENGTH
    assert text.take() == "cc"  # max_tokens: nothing is held back any more


def test_the_token_rules_name_the_reason_when_the_same_token_completes_a_stop_string():
    seq = sequence(stop=["ab"], max_tokens=2)
    text = Detokenizer(Letters(), seq.params.stop)
    assert append_until_stop(seq, letters("ab"), LIMITS, text) is FinishReason.LENGTH
    assert text.take() == ""  # the text still ends before the stop string
