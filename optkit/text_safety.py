"""Text that came from a file, made safe to print on a terminal.

A name or value read from a model file, a GGUF header or a directory listing may hold ESC, OSC
and other control sequences (which move the cursor, retitle the window, or hide what follows),
bidirectional overrides (which show text in another order than it is), or lone surrogates from
undecodable bytes (which make `print` raise). `printable` writes each of them as a Python escape,
so what the user reads is what the file holds, on one line."""

import re

# C0 controls (newline and tab included: one name, one line), DEL, C1 controls, the bidirectional
# embeddings, overrides and isolates, the Arabic letter mark, and surrogates
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """`text` as a string with every control character, bidi override and surrogate escaped
    (ESC -> \\x1b, U+202E -> \\u202e); a backslash stays as it is."""
    return _UNSAFE.sub(_escape, str(text))


def rich_text(text: object):
    """`printable(text)` as a rich Text: shown literally, never read as markup (`[/]`, `[red]`)."""
    from rich.text import Text

    return Text(printable(text))
