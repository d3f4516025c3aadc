"""The training text every Python installation has: the standard library's own sources.

Files are listed in a fixed (sorted) order and split by a hash of their relative path, so
the held-out modules never appear in training on any machine with the same Python.
"""

import hashlib
import sysconfig
from pathlib import Path

# Test suites are huge and repetitive; site-packages is not the standard library.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
HELDOUT_PERCENT = 8
SPLITS = ("train", "heldout")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest()[:8], 16) % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def stdlib_files(split: str) -> list[Path]:
    """Sorted `.py` files of the standard library that fall into `split`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(relative.parts):
            continue
        if split_of(relative.as_posix()) == split:
            files.append(path)
    return files


def read_texts(split: str) -> list[str]:
    """The non-empty texts of a split, in file order."""
    texts = (p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(split))
    return [t for t in texts if t.strip()]
