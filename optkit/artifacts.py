"""Writing output directories so that a reader never sees a half-written one.

A temporary directory `.NAME.tmp-*` holds an output until it is complete, then is renamed to NAME.
It records its owner (pid, host, process start time) in `.optkit-owner`, so that a later run can
tell the leftovers of a killed run (removed) from a directory another run is still writing (kept).

Nothing optkit did not write is ever deleted: `check_replaceable` is the one rule every place that
deletes or replaces a directory obeys (an empty directory, or an optkit output nobody added to).
"""

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from optkit.errors import OptkitError

log = logging.getLogger(__name__)

OWNER = ".optkit-owner"  # in a temporary output directory, removed before the rename
MANIFEST = "optkit.json"  # an output's list of its files (optkit/manifest.py writes and checks it)


def check_writable_dir(path: Path, what: str, named: Path | None = None) -> None:
    """Refuse, before any work, a directory that cannot be created or written into: `path` itself
    or its nearest existing ancestor must be a directory this process may write. `what` names the
    setting to change (e.g. "--out"), `named` the value the user gave (default: `path`)."""
    _check_creatable(Path(named or path), Path(path), what)


def check_output_dir(out: Path, overwrite: bool, what: str = "--out", own_files: frozenset[str] = frozenset()) -> None:
    """Refuse an output directory that exists (without `overwrite`), that optkit may not replace
    (`check_replaceable`: not even with `overwrite`), or whose parent cannot be written; `what`
    names the setting to change."""
    out = Path(out)
    if os.path.lexists(out):
        check_replaceable(out, what, own_files)
        if not overwrite:
            raise OptkitError(f"output {out} already exists: pass --overwrite or choose another {what}")
    _check_creatable(out, out.parent, what)


def check_replaceable(path: Path, what: str = "--out", own_files: frozenset[str] = frozenset()) -> None:
    """The rule for every directory optkit deletes or replaces (outputs, the work and scratch
    directories beside them): only an empty directory, or an optkit output nobody added to (each
    of its files listed in its optkit.json), goes. A symlink is never followed, a file or anything
    else is never replaced here, and no option changes that. `what` names the setting that chose
    `path`; OptkitError when it may not go. `own_files`: names that count as listed, for the one
    writer of optkit's own locations that keeps no manifest (the zoo's bundled models)."""
    path = Path(path)
    if path.is_symlink():
        raise OptkitError(
            f"{what} {path} is a symlink: optkit never replaces or deletes through one; "
            f"choose another {what} or remove the link yourself"
        )
    if not path.exists():
        return
    if not path.is_dir():
        raise OptkitError(f"{what} {path} exists and is not a directory: choose another {what}")
    stray = _unlisted_entry(path, own_files)
    if stray is not None:
        raise OptkitError(
            f"{what} {path} already exists and is not an optkit output ({stray} is not listed in its "
            f"{MANIFEST}): optkit replaces only an empty directory or one it wrote; choose another {what} "
            "or empty it yourself"
        )


def check_work_dir(path: Path, what: str) -> None:
    """A directory optkit keeps its own records in and writes into (`optkit run`'s `.NAME.work`):
    refused when it is a symlink or not a directory, so nothing is written or deleted through it."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        kind = "a symlink" if path.is_symlink() else "not a directory"
        raise OptkitError(
            f"{path}, the work directory of {what}, is {kind}: optkit never writes through one; move it away"
        )


def remove_dir(path: Path, what: str) -> None:
    """Delete `path` if it is there and `check_replaceable` lets it go (OptkitError if not)."""
    check_replaceable(path, what)
    if Path(path).exists():
        shutil.rmtree(path)


def _unlisted_entry(directory: Path, own_files: frozenset[str] = frozenset()) -> str | None:
    """The first entry under `directory` (a file, link or anything but a real directory) that its
    optkit.json does not list, by relative name; None when there is none. Links are not followed."""
    listed = _listed_files(directory) | own_files

    def unreadable(error: OSError) -> None:
        raise error

    for parent, dirs, files in os.walk(directory, onerror=unreadable):
        linked = [d for d in dirs if os.path.islink(os.path.join(parent, d))]
        for entry in sorted(files + linked):
            name = Path(parent, entry).relative_to(directory).as_posix()
            if name != MANIFEST and name not in listed:
                return name
    return None


def _listed_files(directory: Path) -> set[str]:
    """The names optkit.json's "files" lists; none when it is missing or unreadable."""
    try:
        files = json.loads((directory / MANIFEST).read_text()).get("files")
    except (OSError, ValueError, AttributeError, RecursionError):
        return set()
    return {name for name in files if isinstance(name, str)} if isinstance(files, dict) else set()


def _check_creatable(named: Path, directory: Path, what: str) -> None:
    """`directory` (where `named` is written) exists as a writable directory or can be made in one."""
    existing = directory
    while not existing.exists() and not existing.is_symlink() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        kind = "a file" if existing.is_file() else "not a directory"
        raise OptkitError(f"{what} {named}: {existing} is {kind}: choose another {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OptkitError(
            f"{what} {named}: cannot write in {existing} (permission denied or read-only): "
            f"choose another {what} or make {existing} writable"
        )


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after "pid (comm)" (state first), or None where there is no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """When the kernel started process `pid` (clock ticks since boot): it tells the owner of a
    temporary directory from a later process that got the same pid."""
    fields = _proc_stat(pid)
    return fields[19] if fields else None  # starttime is field 22 of the whole line


def _owner_alive(owner: dict) -> bool:
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    fields = _proc_stat(owner["pid"])
    if fields is None:
        return True  # nothing more to ask: a live pid is taken to be the owner
    if fields[0] == "Z":
        return False  # exited, not yet reaped
    return owner["started"] in (None, fields[19])


def _read_owner(tmp: Path) -> dict | None:
    try:
        owner = json.loads((tmp / OWNER).read_text())
        return {"pid": int(owner["pid"]), "host": str(owner["host"]), "started": owner.get("started")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_stale_temporaries(out: Path) -> None:
    """Remove the temporary directories of `out` that a killed run left (their owner process is
    gone), one log line each. A directory whose owner is alive is never touched; one that records
    no owner (an older optkit) or an owner on another host is left, with a line saying so."""
    out = Path(out)
    host = socket.gethostname()
    for tmp in sorted(out.parent.glob(f".{glob.escape(out.name)}.tmp-*")):
        if tmp.is_symlink() or not tmp.is_dir():
            continue
        owner = _read_owner(tmp)
        if owner is None:
            log.warning(
                "left %s alone: it names no owner process (an older optkit made it, or one is starting); "
                "delete it if no optkit is writing %s",
                tmp,
                out,
            )
        elif owner["host"] != host:
            log.warning(
                "left %s alone: pid %d on host %s is writing it; delete it if that run is over",
                tmp,
                owner["pid"],
                owner["host"],
            )
        elif not _owner_alive(owner):
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("removed stale temporary directory %s from an interrupted run (pid %d)", tmp, owner["pid"])


def _owned_temporary(out: Path, what: str) -> Path:
    """A new `.NAME.tmp-*` beside `out` that records its owner (this process)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OptkitError(f"output {out}: cannot create {out.parent} ({e.strerror}): choose another {what}") from e
    remove_stale_temporaries(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    pid = os.getpid()
    owner = {"pid": pid, "host": socket.gethostname(), "started": _process_start(pid)}
    (tmp / OWNER).write_text(json.dumps(owner) + "\n")
    return tmp


@contextlib.contextmanager
def scratch_dir(near: Path, what: str = "--out") -> Iterator[Path]:
    """A new working directory beside `near` (a `.NAME.tmp-*`, as an output's temporary), removed
    when the block ends, however it ends; a killed run's is removed by the next for `near`."""
    tmp = _owned_temporary(Path(near), what)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(
    out: Path, *, overwrite: bool, what: str = "--out", own_files: frozenset[str] = frozenset()
) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` only if the block completes.

    On any exception (Ctrl-C included) the temporary directory is removed and `out` is
    untouched, so an interrupted run leaves nothing at `out`. A run killed outright (SIGKILL,
    power loss) leaves its temporary directory; the next run for the same `out` removes it.
    An `out` already there is replaced only as `check_replaceable` allows, checked again at the end.
    """
    out = Path(out)
    check_output_dir(out, overwrite, what, own_files)
    tmp = _owned_temporary(out, what)
    try:
        umask = current_umask()
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should not be
        yield tmp
        (tmp / OWNER).unlink()
        for path in tmp.rglob("*"):  # some writers create private files; an artifact is for sharing
            if path.is_file():
                os.chmod(path, 0o666 & ~umask)
        replace_dir(tmp, out, what, own_files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_output_file(out: Path) -> Iterator[Path]:
    """A new private temporary file `.NAME.tmp-*` beside `out` (made new, never a planted link),
    renamed to `out` once the block completes (readable as a release is), removed if it fails."""
    handle, name = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's file is private; a release is for sharing
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process's umask (reading it means setting it: put straight back)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def replace_dir(source: Path, out: Path, what: str = "--out", own_files: frozenset[str] = frozenset()) -> None:
    """Move the finished directory `source` to `out` in one rename, replacing what is there only
    as `check_replaceable` allows."""
    out = Path(out)
    check_replaceable(out, what, own_files)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / out.name)
        os.replace(source, out)
        shutil.rmtree(trash)
    else:
        os.replace(source, out)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(directory: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path."""
    return {
        p.relative_to(directory).as_posix(): file_sha256(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.relative_to(directory).as_posix() not in (*exclude, OWNER)
    }


_identity_cache: dict[tuple, str] = {}


def content_sha256(path: Path) -> str:
    """sha256 of a file, or of a directory's files (relative path and bytes, in sorted order).

    This is the identity of a base model or data set in cache keys and manifests; one run asks for
    it several times (pipeline stage key, manifest, reference cache), so within a process it is
    remembered for as long as no file's size or modification time changes. (Integrity checks, as
    in `optkit verify`, always read the bytes: they use `file_sha256`.)"""
    path = Path(path).resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    signature = (str(path), tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if signature not in _identity_cache:
        if not path.is_dir():
            _identity_cache[signature] = file_sha256(path)
        else:
            digest = hashlib.sha256()
            for name, file_digest in file_hashes(path).items():
                digest.update(f"{name}\0{file_digest}\n".encode())
            _identity_cache[signature] = digest.hexdigest()
    return _identity_cache[signature]
