"""JSON that every parser reads. NaN and ±Infinity are not JSON (JavaScript's `JSON.parse` and
strict parsers reject them), yet Python's `json` writes them: every JSON file and line optkit
writes goes through `dumps`, which writes a non-finite number as null and refuses any left."""

import json
import math


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
