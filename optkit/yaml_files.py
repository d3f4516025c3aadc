"""Reading the YAML files users give (recipes, tiers, `--set` values): a mapping, or a one-line error saying why not.

A recipe or a routing config may come from someone else, so the one reader is bounded: yaml's safe
types only (no tag builds an object), UTF-8 text of at most MAX_BYTES, no anchors or aliases (a few
hundred bytes of aliases to aliases expand to gigabytes, the "billion laughs"), and at most MAX_DEPTH
levels of nesting (yaml's composer recurses once per level: 5,000 levels are a RecursionError).
No recipe needs any of these; each is refused in one line naming the file and the line.
"""

from pathlib import Path

import yaml

from optkit.errors import OptkitError, shorten

MAX_BYTES = 1 << 20  # recipes are a few hundred bytes; a tiers file with many rules, a few KiB
MAX_DEPTH = 64  # a recipe nests 4 levels (serve.models.NAME.path)


class _Refused(yaml.YAMLError):
    """A construct the bounded loader does not take."""


class _BoundedLoader(yaml.SafeLoader):
    """safe_load, refusing anchors, aliases and nesting past MAX_DEPTH before it builds anything."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refused(
                f"line {line}: YAML anchors and aliases (&{event.anchor}, *{event.anchor}) are not allowed "
                "here: write the value out"
            )
        if self._depth >= MAX_DEPTH:
            raise _Refused(f"line {line}: nested more than {MAX_DEPTH} levels deep")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str):
    """The data of one YAML document, read by the bounded loader (yaml.YAMLError or ValueError if not)."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml_mapping(path: str | Path, what: str, *, missing_hint: str = "", keys_hint: str = "") -> dict:
    """The file's top-level mapping. `what` names the file in errors ("recipe", "--tiers");
    `missing_hint` and `keys_hint` end the messages for a missing file and for a file that is
    not a mapping."""
    file = Path(path)
    if not file.exists():
        raise OptkitError(f"{what} {path} does not exist: give a YAML file{missing_hint}")
    if not file.is_file():
        raise OptkitError(f"{what} {path} is not a regular file: give a YAML file{missing_hint}")
    with file.open("rb") as stream:
        raw = stream.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise OptkitError(f"{what} {file} is larger than {MAX_BYTES >> 20} MiB: a recipe is a few lines of YAML")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise OptkitError(
            f"{what} {file} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): save it as UTF-8"
        ) from None
    try:
        data = load_yaml(text)
    except _Refused as e:
        raise OptkitError(f"{what} {file}, {shorten(str(e), 200)}") from None
    except yaml.YAMLError as e:
        raise OptkitError(f"{what} {file} is not valid YAML: {_yaml_problem(e)}") from None
    except ValueError as e:  # a value yaml parses but Python refuses: a 5,000-digit integer, a 13th month
        raise OptkitError(f"{what} {file} holds a value that cannot be read: {shorten(str(e))}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OptkitError(f"{what} {file} must be a mapping of keys{keys_hint}")
    return data


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What yaml found wrong, and where, on one line."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if problem is None:
        return shorten(str(error).splitlines()[0] if str(error) else type(error).__name__)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return shorten(problem) + where
