"""Incremental detokenisation with stop strings: the new, final text of a request's output.

Text is decoded from all output tokens and diffed against what was already emitted, so byte-level
BPE tokens that split a UTF-8 character never leak a replacement character: text ending in
U+FFFD waits for the next token. The last `len(longest stop) - 1` characters are held back until
it is clear they do not begin a stop string, so a stop string never reaches the client. Where the
output stops is decided in runtime/stopping.py, which feeds a request with stop strings one token
at a time; the text waits in `pending` until the engine `take`s it for its next output.
"""

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0  # characters of the output text already returned
        self.stopped = False
        self.pending = ""  # new text not yet taken

    def watch(self, output_token_ids: list[int], finished: bool) -> bool:
        """Decode the output so far (`finished`: it ends here) and keep its new text for `take`;
        True once a stop string appeared (the text is then cut before it)."""
        self.pending += self._new_text(output_token_ids, finished)
        return self.stopped

    def take(self) -> str:
        """The new text watched since the last call."""
        text, self.pending = self.pending, ""
        return text

    def _new_text(self, output_token_ids: list[int], finished: bool) -> str:
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
