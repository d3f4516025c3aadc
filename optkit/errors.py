"""User-facing errors: each message says what is wrong and what to change."""

from optkit.text_safety import printable


class OptkitError(Exception):
    """A mistake in the user's input; the CLI prints it on one line and exits with code 2."""

    exit_code = 2


MAX_VALUE_CHARS = 120  # a value quoted from a file (recipe, routing config), as an error line shows it
MAX_LINE_CHARS = 1000  # a whole error line


def shorten(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """`text` for an error line: control characters (newlines, ESC) escaped, and at most `limit`
    characters, the middle elided, so that nothing from a file floods or drives the terminal."""
    text = printable(text)
    if len(text) <= limit:
        return text
    keep = max(limit - len(f" …({len(text)} characters)… "), 2)
    head, tail = keep - keep // 3, keep // 3
    return f"{text[:head]} …({len(text) - head - tail} characters)… {text[len(text) - tail :]}"


def shown(value: object, limit: int = MAX_VALUE_CHARS) -> str:
    """repr(value), shortened for an error line."""
    return shorten(repr(value), limit)


def shown_shape(tensor) -> str:
    """A tensor's (or array's) shape for an error line: [128, 384]."""
    return "[" + ", ".join(map(str, tensor.shape)) + "]"
