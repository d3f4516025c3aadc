"""An earlier revision of one of optkit's C++ kernel libraries, built beside the shipped one for A/B
runs in one process (bench/cpu_decode_attention.py, bench/cpu_w4a8_tile_ab.py).

The library's source and every header of optkit/kernels/ are read as they were at the revision (`git
show REV:optkit/kernels/NAME`), its TORCH_LIBRARY namespace renamed, and the result built by
kernels/cpp_build.py like the shipped library (cached under its own hash).
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "optkit/kernels"


def git_show(revision: str, path: str) -> str | None:
    """The text of `path` at `revision` of this checkout; None where it did not exist there."""
    done = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def build_at(revision: str, source: str, namespace: str) -> str:
    """Build optkit/kernels/`source` as it was at `revision`, its operators under `namespace`_baseline;
    that namespace's name. Exits with one line where the revision or the build fails."""
    from optkit.kernels import cpp_build

    text = git_show(revision, f"{KERNELS}/{source}")
    if text is None:
        sys.exit(f"{KERNELS}/{source} is not in revision {revision!r} of this checkout")
    declared = f"TORCH_LIBRARY({namespace},"
    if declared not in text:
        sys.exit(f"{source} at {revision} does not declare {declared}: pass a revision with that library")
    baseline = f"{namespace}_baseline"
    scratch = Path(tempfile.mkdtemp(prefix=f"optkit-{baseline}-"))
    try:
        (scratch / source).write_text(text.replace(declared, f"TORCH_LIBRARY({baseline},"))
        listed = subprocess.run(
            ["git", "ls-tree", "--name-only", f"{revision}:{KERNELS}"], cwd=ROOT, capture_output=True, text=True
        )
        for name in listed.stdout.split():
            if name.endswith(".h"):
                (scratch / name).write_text(git_show(revision, f"{KERNELS}/{name}") or "")
        reason = cpp_build.load(scratch / source, baseline)
    finally:
        shutil.rmtree(scratch)
    if reason:
        sys.exit(f"cannot build {source} at {revision}: {reason}")
    return baseline
