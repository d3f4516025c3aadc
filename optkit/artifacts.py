"""Writing output directories so that a reader never sees a half-written one."""

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from optkit.errors import OptkitError


def check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise OptkitError(f"output {out} already exists: pass --overwrite or choose another --out")
    if out.exists() and not out.is_dir():
        raise OptkitError(f"output {out} exists and is not a directory: choose another --out")


@contextlib.contextmanager
def atomic_output_dir(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary sibling of `out`; rename it to `out` only if the block completes.

    On any exception (Ctrl-C included) the temporary directory is removed and `out` is
    untouched, so an interrupted run leaves nothing at `out`.
    """
    out = Path(out)
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should not be
    try:
        yield tmp
        for path in tmp.rglob("*"):  # some writers create private files; an artifact is for sharing
            if path.is_file():
                os.chmod(path, 0o666 & ~umask)
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)
            os.replace(tmp, out)
            shutil.rmtree(trash)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
        if p.is_file() and p.relative_to(directory).as_posix() not in exclude
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
