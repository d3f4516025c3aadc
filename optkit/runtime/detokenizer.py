"""Incremental detokenisation with stop strings: each call returns only the new, final text.

Text is decoded from all output tokens and diffed against what was already emitted, so byte-level
BPE tokens that split a UTF-8 character never leak a replacement character: text ending in
U+FFFD waits for the next token. The last `len(longest stop) - 1` characters are held back until
it is clear they do not begin a stop string, so a stop string never reaches the client.
"""

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0  # characters of the output text already returned
        self.stopped = False

    def update(self, output_token_ids: list[int], finished: bool) -> str:
        """The new text for the output so far; sets `stopped` when a stop string appeared
        (the text is then cut before it and the sequence should finish)."""
        text = self.tokenizer.decode(output_token_ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop, max(0, self.emitted - len(stop) + 1))
            if at != -1:
                text, finished, self.stopped = text[:at], True, True
        end = len(text)
        if not finished:
            if text.endswith(REPLACEMENT):
                end = len(text.rstrip(REPLACEMENT))
            end = min(end, len(text) - self.hold_back)
        if end <= self.emitted:
            return ""
        new, self.emitted = text[self.emitted : end], end
        return new

    def update_each(self, output_token_ids: list[int], num_seen: int, finished: bool) -> tuple[str, int]:
        """`update` for several new tokens at once (speculative decoding), one token at a time from
        the first one not seen yet: the new text, and how many output tokens to keep, so that a stop
        string ends the output at the token that completes it."""
        text, total = "", len(output_token_ids)
        for n in range(num_seen + 1, total + 1):
            text += self.update(output_token_ids[:n], finished and n == total)
            if self.stopped:
                return text, n
        return text, total
