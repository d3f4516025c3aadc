"""`optkit.json`: what was done to make an artifact, from what, and the sha256 of every file.

An artifact comes from someone else, so every name it holds is checked before it is joined to the
directory (`confined_file`): a file name stays inside the artifact (no absolute path, no `..`, no
symlink that leads out) and names a regular file (no FIFO, device or socket). Nothing outside the
artifact is opened, hashed or reported on, so `optkit verify` tells nothing about other files.
"""

import datetime
import json
import os
import platform
import stat
from pathlib import Path, PurePosixPath

from optkit import __version__
from optkit.artifacts import MANIFEST, file_hashes, file_sha256
from optkit.errors import OptkitError
from optkit.json_strict import dumps, finite

_MAX_LINKS = 40  # symlinks followed while resolving one name (the kernel's own limit)


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
    """Write `optkit.json` last, with the sha256 of every other file in `directory`; returns it as
    written: strict JSON, where a NaN (the loss of a layer no calibration measured) is null."""
    manifest = {
        "optkit_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        **fields,
        "files": file_hashes(directory, exclude=(MANIFEST,)),
    }
    manifest = finite(manifest)
    (directory / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(directory: Path) -> dict | None:
    """The artifact's `optkit.json` (None when there is none), its "files" checked to be a mapping of
    file names to sha256 digests."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # ValueError: not JSON, not UTF-8, or an int of 4,300+ digits
        raise OptkitError(f"{path} is not valid JSON ({_reason(e)}): re-create or re-download the artifact") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise OptkitError(
            f'{path}: "files" must map file names to sha256 digests: re-create or re-download the artifact'
        )
    return manifest


def _reason(e: Exception) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at line {e.lineno}"
    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8"
    return "nested too deeply" if isinstance(e, RecursionError) else "a number too long to read"


def verify_files(directory: Path, manifest: dict) -> list[str]:
    """One line per file that is missing, changed, or present but not in the manifest. A name or an
    entry that leads outside the directory, or that is not a regular file, raises OptkitError."""
    problems = []
    for name, digest in manifest.get("files", {}).items():
        path = confined_file(directory, name, MANIFEST)
        if path is None:
            problems.append(f"{name}: missing")
        elif file_sha256(path) != digest:
            problems.append(f"{name}: sha256 differs from optkit.json")
    listed = set(manifest.get("files", {})) | {MANIFEST}
    problems += [f"{name}: not listed in optkit.json" for name in artifact_files(directory) if name not in listed]
    return problems


def confined_file(directory: Path, name: str, source: str | None = None) -> Path | None:
    """The regular file that `name` (a relative POSIX path, e.g. from a manifest) names inside
    `directory`, resolved; None when there is none. OptkitError when the name or a symlink on its
    way leads outside `directory`, or when it names anything but a regular file. `source` names
    where the name was read, for the message."""
    path = _resolve_inside(directory, name, source)
    if path is not None and not stat.S_ISREG(os.stat(path).st_mode):
        raise OptkitError(
            f"{directory}/{name}{_named_in(source)} is not a regular file (a directory, FIFO, device or socket): "
            "optkit reads only regular files; remove it or re-create the artifact"
        )
    return path


def artifact_files(directory: Path) -> list[str]:
    """The relative names of the regular files under `directory` (symlinks to files inside it
    included), sorted. OptkitError for an entry that leads outside it or is no regular file."""
    names = []
    for parent, dirs, files in os.walk(directory):  # does not descend into linked directories
        for entry in dirs:
            if os.path.islink(os.path.join(parent, entry)):  # allowed when it stays inside
                _resolve_inside(directory, Path(parent, entry).relative_to(directory).as_posix(), None)
        for entry in files:
            name = Path(parent, entry).relative_to(directory).as_posix()
            if confined_file(directory, name) is not None:  # None: a dangling link inside
                names.append(name)
    return sorted(names)


def _resolve_inside(directory: Path, name: str, source: str | None) -> Path | None:
    """`directory/name` with every symlink resolved, one component at a time; None when a component
    is missing. A link that leads out is refused from its text alone, so nothing outside
    `directory` is ever looked at (stat, open or hash)."""
    outside = OptkitError(
        f"{directory}/{name}{_named_in(source)} leads outside the artifact: optkit reads only files inside "
        "it; replace links with the files they point to, or re-create the artifact"
    )
    pure = PurePosixPath(name)
    if not name or "\0" in name or pure.is_absolute() or ".." in pure.parts:
        raise outside
    root = Path(os.path.realpath(directory))
    current, pending, links = root, list(pure.parts), 0
    while pending:
        part = pending.pop(0)
        if part == "..":  # only from a link's target
            if current == root:
                raise outside
            current = current.parent
            continue
        try:
            mode = os.lstat(current / part).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISLNK(mode):
            current = current / part
            continue
        links += 1
        if links > _MAX_LINKS:
            raise OptkitError(
                f"{directory}/{name}{_named_in(source)}: too many levels of symlinks: re-create the artifact"
            )
        target = PurePosixPath(os.readlink(current / part))
        if target.is_absolute():
            if not target.is_relative_to(root):
                raise outside
            current, target = root, target.relative_to(root)
        pending = [*target.parts, *pending]
    return current


def _named_in(source: str | None) -> str:
    return f" (named in {source})" if source else ""
