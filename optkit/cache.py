"""Where optkit keeps what it builds for itself (eval sets, tokenizers): $OPTKIT_CACHE or ~/.cache/optkit."""

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache's root, not created."""
    return Path(os.environ.get("OPTKIT_CACHE") or Path.home() / ".cache" / "optkit")


def cache_dir(*parts: str) -> Path:
    path = cache_root().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
