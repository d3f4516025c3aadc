"""`optkit.json`: what was done to make an artifact, from what, and the sha256 of every file."""

import datetime
import json
import platform
from pathlib import Path

from optkit import __version__
from optkit.artifacts import file_hashes, file_sha256

MANIFEST = "optkit.json"


def versions() -> dict[str, str]:
    """Versions of what produced an artifact; compressed_tensors only where it is installed."""
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers

    found = {
        "optkit": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        found["compressed_tensors"] = version("compressed-tensors")
    except PackageNotFoundError:
        pass
    return found


def write_manifest(directory: Path, fields: dict) -> dict:
    """Write `optkit.json` last, with the sha256 of every other file in `directory`."""
    manifest = {
        "optkit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        **fields,
        "files": file_hashes(directory, exclude=(MANIFEST,)),
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(directory: Path) -> dict | None:
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def verify_files(directory: Path, manifest: dict) -> list[str]:
    """One line per file that is missing, changed, or present but not in the manifest."""
    problems = []
    for name, digest in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif file_sha256(path) != digest:
            problems.append(f"{name}: sha256 differs from optkit.json")
    listed = set(manifest.get("files", {})) | {MANIFEST}
    problems += [
        f"{p.relative_to(directory).as_posix()}: not listed in optkit.json"
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.relative_to(directory).as_posix() not in listed
    ]
    return problems
