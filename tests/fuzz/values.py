"""The values a mutation puts in a field: the edges where readers break (zero, one, negative, the
limits of 32 and 64 bits, NaN, infinities, huge and empty strings, invalid UTF-8, terminal escapes,
rich markup, paths that leave a directory), and plausible ones so that a mutant can also get far."""

import json
import random

INTEGERS = (
    0, 1, 2, 3, 7, 8, 16, 31, 32, 33, 64, 127, 128, 255, 256, 4096, 65535, 65536,
    2**20, 2**24, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
    -1, -2, -(2**31), -(2**63),
)  # fmt: skip
REALS = (
    0.0,
    -0.0,
    1e-300,
    1e-45,
    1e-6,
    0.5,
    1.0,
    2.0,
    -1.0,
    1e30,
    1e38,
    3.5e38,
    1e308,
    float("nan"),
    float("inf"),
    -float("inf"),
)
TEXTS = (
    "", " ", "0", "4", "-1", "1e9", "nan", "true", "null", "auto", "default", "linear", "llama", "gptq", "gguf",
    "a" * 5000, "[/]", "[bold red]x[/]", "\x1b]0;pwned\x07", "\x1b[2J\x1b[H", "\r\n", "line\nbreak", "\x00", "é☃𝄞",
    "../../../etc/passwd", "/etc/passwd", "~", "$HOME", "{{ 7*7 }}", "%s%n", "((\\w|\\.)*)*!", "re:.*", "\ud800",
)  # fmt: skip
BAD_BYTES = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xfe\xff")


def integer(rng: random.Random) -> int:
    return rng.choice(INTEGERS) if rng.random() < 0.85 else rng.randrange(-1000, 1000)


def real(rng: random.Random) -> float:
    return rng.choice(REALS) if rng.random() < 0.85 else rng.uniform(-10, 10)


def text(rng: random.Random, old: str = "") -> str:
    r = rng.random()
    if r < 0.6:
        return rng.choice(TEXTS)
    if r < 0.8 and old:  # the old string with a hostile piece spliced in
        i = rng.randrange(len(old) + 1)
        return old[:i] + rng.choice(TEXTS[:20]) + old[i:]
    return old * rng.choice((0, 2, 100)) if old else rng.choice(TEXTS)


def text_bytes(rng: random.Random, old: bytes = b"") -> bytes:
    if rng.random() < 0.25:  # not UTF-8
        i = rng.randrange(len(old) + 1)
        return old[:i] + rng.choice(BAD_BYTES) + old[i:]
    return text(rng, old.decode("utf-8", "replace")).encode("utf-8", "surrogatepass")


def scalar(rng: random.Random, old=None):
    """A JSON/YAML value of any kind, often of a kind `old` is not."""
    kind = rng.choice(("int", "int", "real", "text", "bool", "none", "list", "dict", "same"))
    if kind == "same" and isinstance(old, bool):
        return not old
    if kind == "same" and isinstance(old, int):
        return rng.choice((0, -old, old * 2**20, old + 1, old - 1, str(old), float(old)))
    if kind == "same" and isinstance(old, float):
        return rng.choice(
            (0.0, -old, old * 1e30, float("nan"), str(old), int(old) if old == old and abs(old) < 1e18 else 0)
        )
    if kind == "same" and isinstance(old, str):
        return text(rng, old)
    if kind in ("int", "same"):
        return integer(rng)
    if kind == "real":
        return real(rng)
    if kind == "text":
        return text(rng)
    if kind == "bool":
        return rng.choice((True, False))
    if kind == "list":
        return rng.choice(([], [1], [0, 0], ["a"], [None], [[1]], [{}], list(range(200))))
    if kind == "dict":
        return rng.choice(({}, {"a": 1}, {"": None}, {"type": "x"}, {"1": [2]}))
    return None


def json_text(rng: random.Random, base=None) -> str:
    """A JSON document (or not quite one), for JSON held inside another file."""
    choice = rng.random()
    if choice < 0.3:
        return rng.choice(
            ("", "[1]", "null", "1", '"x"', "{", "[]", "{}", "NaN", '{"a": NaN}', "[" * 2000 + "]" * 2000)
        )
    if choice < 0.45:
        return "[" * 100_000 + "]" * 100_000
    doc = dict(base) if isinstance(base, dict) else {}
    key = rng.choice(list(doc) or ["method"])
    doc[key] = scalar(rng, doc.get(key))
    return json.dumps(doc)
