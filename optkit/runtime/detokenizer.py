"""Incremental detokenisation with stop strings: the new, final text of a request's output.

The text is that of all output tokens decoded at once, diffed against what was already emitted, so
byte-level BPE tokens that split a UTF-8 character never leak a replacement character: text ending
in U+FFFD waits for the next token. It is decoded incrementally, as vLLM and TGI do: each call
decodes a window of the last tokens (the previous call's new ones and this call's) and appends what
the new ones add to the window's text, so a step costs the same at the 2,000th token as at the
first (decoding every output token at every step made a long generation's steps grow with its
length). Where a window's text does not extend its prefix's (a tokenizer whose decoding of a token
depends on more than the token before it), that call decodes all the tokens. The last
`len(longest stop) - 1` characters are held back until it is clear they do not begin a stop string,
so a stop string never reaches the client. Where the output stops is decided in runtime/stopping.py,
which feeds a request with stop strings one token at a time; the text waits in `pending` until the
engine `take`s it for its next output.
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
        # incremental decoding: `decoded` is the text of the tokens before `read_offset`; the next
        # window starts at `prefix_offset` (the tokens the last call added)
        self.decoded, self.prefix_offset, self.read_offset = "", 0, 0

    def watch(self, output_token_ids: list[int], finished: bool) -> bool:
        """Decode the output so far (`finished`: it ends here) and keep its new text for `take`;
        True once a stop string appeared (the text is then cut before it)."""
        self.pending += self._new_text(output_token_ids, finished)
        return self.stopped

    def take(self) -> str:
        """The new text watched since the last call."""
        text, self.pending = self.pending, ""
        return text

    def _text(self, ids: list[int]) -> str:
        """The text of all of `ids` (decode(ids)), decoding only the window of the last tokens."""
        if len(ids) < self.read_offset:  # not the tokens seen before: start again
            self.decoded, self.prefix_offset, self.read_offset = "", 0, 0
        prefix = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        window = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        if not window.startswith(prefix):  # all of it, and the next window starts from the first token
            self.decoded, self.prefix_offset, self.read_offset = "", 0, 0
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        added = window[len(prefix) :]
        text = self.decoded + added
        # the new tokens settle once they end a whole character; the next window starts at them only
        # where they have text (a window must not start at tokens decoding to nothing, such as skipped
        # special tokens: its first token with text would lose a metaspace's leading space)
        if added and not text.endswith(REPLACEMENT):
            self.decoded, self.prefix_offset, self.read_offset = text, self.read_offset, len(ids)
        return text

    def _new_text(self, output_token_ids: list[int], finished: bool) -> str:
        text = self._text(output_token_ids)
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
