"""Where optkit keeps what it builds for itself (eval sets, tokenizers): $OPTKIT_CACHE or ~/.cache/optkit.

Two parts of it hold code that optkit runs: the compile cache ($OPTKIT_CACHE/compile: torch.compile's
pickles, runtime/compile_cache.py) and the C++ operator libraries ($OPTKIT_CACHE/kernels: shared
objects loaded with dlopen, kernels/cpp_build.py). Their directories are made writable by this user
alone, and one that another user owns or may write into is refused (`check_private`). Only the
cache's own directories are checked, not their ancestors (CI keeps the cache under its clone).
"""

import os
import stat
from pathlib import Path

from optkit.errors import OptkitError

PRIVATE_DIR_MODE = 0o755  # owner-writable whatever the umask (a umask of 002 would make 775)


def cache_root() -> Path:
    """The cache's root, not created."""
    return Path(os.environ.get("OPTKIT_CACHE") or Path.home() / ".cache" / "optkit")


def cache_dir(*parts: str) -> Path:
    path = cache_root().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def make_private_dirs(path: Path, top: Path) -> None:
    """Create `path` and its missing parents up to `top` (the code-holding part of the cache, e.g.
    $OPTKIT_CACHE/compile) writable by this user alone; `top`'s own parents are made as usual."""
    top.parent.mkdir(parents=True, exist_ok=True)
    parts = path.relative_to(top).parts
    for depth in range(len(parts) + 1):
        directory = top.joinpath(*parts[:depth])
        if not directory.is_dir():
            directory.mkdir(mode=PRIVATE_DIR_MODE, exist_ok=True)


def check_private(path: Path, what: str) -> None:
    """Refuse, in one line, a directory or file of the cache that optkit loads code from when another
    user owns it or its own permissions let the group or others write into it (its ancestors are not
    checked). Nothing to check where it does not exist, or on a system without POSIX owners."""
    if not hasattr(os, "geteuid"):
        return
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    if info.st_uid != os.geteuid():
        raise OptkitError(
            f"{what} {path} belongs to another user (uid {info.st_uid}): optkit runs code from it; "
            "point OPTKIT_CACHE at a directory of your own"
        )
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if info.st_mode & bit]
    if writable:
        raise OptkitError(
            f"{what} {path} is writable by {' and '.join(writable)} (mode {stat.S_IMODE(info.st_mode):o}): "
            f"optkit runs code from it; run chmod go-w {path}"
        )
