"""JSON that every parser reads. NaN and ±Infinity are not JSON (JavaScript's `JSON.parse` and
strict parsers reject them), yet Python's `json` writes them: every JSON file and line optkit
writes goes through `dumps`, which writes a non-finite number as null and refuses any left.

And JSON that optkit reads from somewhere else (a model directory's config.json, tokenizer.json,
generation_config.json, an index, a manifest): `read_json` / `read_object` turn every way such a
file can be unreadable into one OptkitError naming it."""

import json
import math
from pathlib import Path

from optkit.errors import OptkitError


def finite(value):
    """`value` with every NaN or infinite float (anywhere in its dicts, lists and tuples) None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """json.dumps of `finite(value)`, with allow_nan=False for what `default` may return."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def read_json(file: str | Path, what: str, remedy: str = "repair or re-create it"):
    """The parsed `file`, or one OptkitError: not UTF-8, not JSON, nested past Python's recursion
    limit, or a number Python will not read (an int of more than 4,300 digits)."""
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise OptkitError(f"{file} is not UTF-8 text (byte {e.start}): {remedy}") from e
    except json.JSONDecodeError as e:
        raise OptkitError(f"{file} is not valid JSON ({e.msg} at line {e.lineno}): {remedy}") from e
    except RecursionError as e:
        raise OptkitError(f"{file} is nested too deeply to be {what}: {remedy}") from e
    except ValueError as e:
        raise OptkitError(f"{file} holds a number too long to read: {remedy}") from e


def read_object(file: str | Path, what: str, remedy: str = "repair or re-create it") -> dict:
    """`read_json`, which must be a JSON object (`what` names it in the error: "a tokenizer")."""
    value = read_json(file, what, remedy)
    if not isinstance(value, dict):
        raise OptkitError(f"{file} holds no JSON object, so it is not {what}: {remedy}")
    return value
