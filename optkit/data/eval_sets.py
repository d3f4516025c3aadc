"""Bundled eval and calibration sets, materialised from the running Python's standard library.

A definition (`eval_sets/NAME.yaml`) says how to build a set; the built jsonl lives in the
cache and is identified by the sha256 of its bytes, which reports and manifests record.
"""

import hashlib
import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from optkit.artifacts import content_sha256
from optkit.cache import cache_dir
from optkit.data.corpus import stdlib_files, stdlib_root
from optkit.errors import OptkitError


class SetDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: str  # "text" | "multiple_choice"
    split: str
    seed: int = 0
    max_chars: int = 160_000
    num_questions: int = 200
    num_choices: int = 4
    context_lines: int = 8
    min_line_chars: int = 20


def definitions_dir() -> Path:
    """`optkit/eval_sets` inside an installed wheel, else the repository's `eval_sets/`."""
    packaged = Path(__file__).resolve().parents[1] / "eval_sets"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "eval_sets"


def bundled_names() -> list[str]:
    return sorted(p.stem for p in definitions_dir().glob("*.yaml"))


def load_definition(name: str) -> SetDefinition:
    path = definitions_dir() / f"{name}.yaml"
    try:
        return SetDefinition(**yaml.safe_load(path.read_text()))
    except ValidationError as e:
        raise OptkitError(f"eval set definition {path} is invalid: {e.errors()[0]['msg']}") from e


def materialize(name: str) -> Path:
    """Build (once) the jsonl of a bundled set and return its path in the cache."""
    definition = load_definition(name)
    key = hashlib.sha256((definition.model_dump_json() + sys.version + str(stdlib_root())).encode()).hexdigest()[:16]
    path = cache_dir("eval_sets") / f"{name}-{key}.jsonl"
    if not path.exists():
        builder = _build_text if definition.kind == "text" else _build_multiple_choice
        records = builder(definition)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.rename(path)
    return path


def _relative(path: Path) -> str:
    return path.relative_to(stdlib_root()).as_posix()


def _build_text(d: SetDefinition) -> list[dict]:
    """Whole files in a seeded order until `max_chars`; the last one cut at a line end."""
    files = stdlib_files(d.split)
    random.Random(d.seed).shuffle(files)
    records, remaining = [], d.max_chars
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        if len(text) > remaining:
            text = text[: text.rfind("\n", 0, remaining) + 1]
        if text.strip():
            records.append({"text": text, "source": _relative(path)})
        remaining -= len(text)
        if remaining <= 0:
            break
    return records


def _build_multiple_choice(d: SetDefinition) -> list[dict]:
    """ "Which line comes next?": context lines, the true next line and distractors from other files."""
    rng = random.Random(d.seed)
    files = stdlib_files(d.split)
    lines_by_file = [p.read_text(encoding="utf-8", errors="replace").splitlines() for p in files]

    def usable(line: str) -> bool:
        return len(line.strip()) >= d.min_line_chars

    records = []
    while len(records) < d.num_questions:
        f = rng.randrange(len(files))
        lines = lines_by_file[f]
        if len(lines) <= d.context_lines:
            continue
        i = rng.randrange(d.context_lines, len(lines))
        if not usable(lines[i]):
            continue
        distractors: list[str] = []
        while len(distractors) < d.num_choices - 1:
            other = rng.randrange(len(files))
            if other == f or not lines_by_file[other]:
                continue
            line = rng.choice(lines_by_file[other])
            if usable(line) and line != lines[i] and line not in distractors:
                distractors.append(line)
        choices = distractors + [lines[i]]
        rng.shuffle(choices)
        records.append(
            {
                "context": "\n".join(lines[i - d.context_lines : i]) + "\n",
                "choices": choices,
                "gold": choices.index(lines[i]),
                "source": _relative(files[f]),
            }
        )
    return records


@dataclass(frozen=True)
class TextSet:
    name: str
    path: Path
    texts: list[str]
    sha256: str


def load_text_set(name_or_path: str, flag: str = "--eval-set") -> TextSet:
    """A bundled set by name, or a local `.txt`, `.jsonl` (a "text" field), `.parquet` or a
    directory saved with `datasets.save_to_disk` (a "text" column). `flag` names the option
    that gave it, for error messages."""
    if name_or_path in bundled_names():
        path = materialize(name_or_path)
        if load_definition(name_or_path).kind != "text":
            raise OptkitError(
                f"{flag} {name_or_path!r} is a task, not text: use a text set "
                f"({', '.join(_text_set_names())}) or a .txt/.jsonl file"
            )
    else:
        path = Path(name_or_path)
        if not path.exists():
            raise OptkitError(
                f"{flag} {name_or_path!r} is neither a bundled set ({', '.join(bundled_names())}) nor an existing file"
            )
    texts = _read_texts(path)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise OptkitError(f"{flag} {name_or_path!r} has no text: give a file with content")
    return TextSet(name=name_or_path, path=path, texts=texts, sha256=content_sha256(path))


def _text_set_names() -> list[str]:
    return [n for n in bundled_names() if load_definition(n).kind == "text"]


def _read_texts(path: Path) -> list[str]:
    if path.is_dir() or path.suffix == ".parquet":
        return _read_with_datasets(path)
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8", errors="replace")]
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise OptkitError(
                    f'{path} line {number}: expected a JSON object with a "text" field ({type(e).__name__})'
                ) from e
        return texts
    raise OptkitError(
        f"{path}: unsupported file type {path.suffix!r}; use .txt, .jsonl, .parquet or a datasets directory"
    )


def _read_with_datasets(path: Path) -> list[str]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path)) if path.is_dir() else datasets.Dataset.from_parquet(str(path))
    except Exception as e:  # datasets raises many types for unreadable data
        raise OptkitError(f"{path}: not a readable dataset ({e.__class__.__name__}: {e})") from e
    if "text" not in ds.column_names:
        raise OptkitError(f"{path}: needs a 'text' column; it has {ds.column_names}")
    return list(ds["text"])
