"""Why and where a sequence stops: the one decision, taken as each new token is appended.

A step appends one token (plain decoding) or up to k + 1 (speculation: the accepted proposals, then
the target's own), one at a time; the first token that stops the sequence is its last and the ones
after it are dropped, so a stop lands on the same token whatever was proposed. A token stops it
for the first of these that holds:
  STOP    it is an EOS token (unless the request ignores EOS) or one of the request's stop_token_ids
  LENGTH  it is the max_tokens-th output token, the sequence reached max_model_len, or the whole KV
          cache could not hold the sequence for the next step
  STOP    the output's text now holds one of the request's stop strings (the text ends before it)
No torch: the text is watched through the request's detokenizer (runtime/detokenizer.py).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from optkit.runtime.sequence import FinishReason, SamplingParams, Sequence


class StopStrings(Protocol):
    """A request's text with its stop strings, fed the output token by token (`Detokenizer`)."""

    def watch(self, output_token_ids: list[int], finished: bool) -> bool:
        """Take the output so far (`finished`: it ends here); True once a stop string appeared."""


@dataclass(frozen=True)
class StopLimits:
    """What stops every sequence of an engine, beside its request's own settings."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int
    max_tokens_held: int  # the longest sequence the whole KV cache holds


def is_stop_token(token: int, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether `token` stops a request of these params by its id alone: an EOS token (unless the
    request ignores EOS) or one of the request's stop_token_ids."""
    return (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids


def token_stop_reason(seq: Sequence, limits: StopLimits) -> FinishReason | None:
    """Why `seq` stops at its last token by that token's id or the sequence's length (None: it goes on)."""
    params = seq.params
    if is_stop_token(seq.token_ids[-1], params, limits.eos_token_ids):
        return FinishReason.STOP
    if seq.num_output_tokens >= params.max_tokens or len(seq) >= limits.max_model_len:
        return FinishReason.LENGTH
    if len(seq) > limits.max_tokens_held:  # the next step needs KV for every token
        return FinishReason.LENGTH
    return None


def append_until_stop(
    seq: Sequence, tokens: Iterable[int], limits: StopLimits, stop_strings: StopStrings | None = None
) -> FinishReason | None:
    """Append `tokens` to `seq` one at a time until one stops it (the rules of the module doc), and
    say why; the tokens after that one are not appended. None: it goes on."""
    for token in tokens:
        seq.append_token(token)
        reason = token_stop_reason(seq, limits)
        if stop_strings is not None and stop_strings.watch(seq.output_token_ids, finished=reason is not None):
            reason = reason or FinishReason.STOP
        if reason is not None:
            return reason
    return None
