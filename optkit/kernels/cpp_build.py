"""Compile and load one of optkit's C++ operator libraries (optkit/kernels/*.cpp) at first use.

torch.utils.cpp_extension builds it with g++ and ninja into $OPTKIT_CACHE/kernels/<name>_<hash>, the
hash over the source, the headers it includes from beside it (`#include "name.h"`, and theirs), the
flags and torch's version, so a machine builds each version once (~20 s) and a changed source, header
or flag never loads a stale library. The libraries register their operators with TORCH_LIBRARY
(torch.ops.<namespace>.*) and are loaded as plain shared objects, not Python modules; one that reads
Python objects (cpu_watch.cpp) is imported as a Python module (`load_module`).

The libraries are code that runs in this process, so the build directory must be this user's own:
$OPTKIT_CACHE/kernels and its <name>_<hash> directories are created writable by this user alone, and
one that another user owns or may write into (or a library in it that is) is never built into or
loaded; the operators then run on the PyTorch path, and the reason, naming the directory and the
chmod that fixes it, is logged once and shown where the C++ path would be (`bench`). A fallback, not
an exit: the first call comes from inside a model's forward, possibly while a server answers.

-fopenmp matters: at::parallel_for is inlined from ATen's headers and runs on one thread unless the
extension itself is compiled with OpenMP (a W4A8 linear on two threads took as long as on one).
"""

import hashlib
import logging
import os
import platform
import re
import threading
from pathlib import Path
from types import ModuleType

import torch

from optkit.errors import OptkitError

log = logging.getLogger(__name__)
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")  # no fused multiply-add where the C++ writes a * b + c
_lock = threading.Lock()  # two threads' first calls must not register the same operators twice


def capped_to_avx2() -> bool:
    """OPTKIT_CPU_ISA=avx2 or ATEN_CPU_CAPABILITY=avx2: run as on a CPU without AVX-512 (A/B runs,
    `bench/cpu_decode.py --isa avx2`)."""
    return "avx2" in (os.environ.get("OPTKIT_CPU_ISA", ""), os.environ.get("ATEN_CPU_CAPABILITY", ""))


# The values of the kernels' `isa` arguments and of their cpu_isa() (kernels/cpu_isa.h's Isa)
ISA_NAMES = {1: "AVX2", 2: "AVX-512 VNNI"}


def capped_isa(best: int) -> int:
    """The instruction set a kernel runs: this CPU's `best` (a library's cpu_isa()), capped to AVX2 (1)
    by capped_to_avx2()."""
    return min(best, 1) if capped_to_avx2() else best


def load(source: Path, prefix: str) -> str:
    """Build (or find) and load the library of `source`; "" when loaded, else why not, in one line."""
    return _build(source, prefix, python_module=False)[1]


def load_module(source: Path, prefix: str) -> tuple[ModuleType | None, str]:
    """Build (or find) and import `source` as a Python module (PYBIND11_MODULE): (the module, "") or
    (None, why not, in one line)."""
    return _build(source, prefix, python_module=True)


def _build(source: Path, prefix: str, python_module: bool) -> tuple[ModuleType | None, str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not x86-64 ({platform.machine()})"
    from torch.utils import cpp_extension

    key = source_bytes(source) + " ".join(FLAGS).encode() + torch.__version__.encode()
    name = f"{prefix}_{hashlib.sha256(key).hexdigest()[:16]}"
    with _lock:
        try:
            build_directory = private_build_directory(name)
        except (OptkitError, OSError) as e:
            reason = f"C++ library not loaded: {e}"
            log.warning("%s", reason)
            return None, reason
        umask = os.umask(0o022)  # ninja's objects and build files, and the library: this user's alone
        try:
            module = cpp_extension.load(
                name,
                [str(source)],
                extra_cflags=list(FLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_directory),
                is_python_module=python_module,
                verbose=False,
            )
        except Exception as e:  # no compiler or ninja, a compile error, an unwritable cache: all mean "not here"
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            return None, f"C++ build failed: {first[:160]}"
        finally:
            os.umask(umask)  # process-wide, so only while the lock is held
    return (module if python_module else None), ""


def source_bytes(source: Path, seen: frozenset[str] = frozenset()) -> bytes:
    """`source` followed by each header it includes from its own directory (g++ finds `#include
    "name.h"` there first), each with the headers it includes in turn, once each."""
    text = source.read_bytes()
    seen = seen | {source.name}
    for name in re.findall(rb'^\s*#\s*include\s+"([^"/]+)"', text, flags=re.MULTILINE):
        if name.decode() not in seen:
            text += source_bytes(source.with_name(name.decode()), seen)
            seen |= {name.decode()}
    return text


def private_build_directory(name: str) -> Path:
    """$OPTKIT_CACHE/kernels/`name`, created writable by this user alone; an OptkitError naming the
    directory when it, the kernels directory or the library already built there is not."""
    from optkit.cache import cache_root, check_private, make_private_dirs

    top = cache_root() / "kernels"
    directory = top / name
    make_private_dirs(directory, top)
    # ninja relinks from the objects and build files there when they look newer: every one is checked
    for path in (top, directory, *sorted(directory.iterdir())):
        check_private(path, "C++ kernel cache")
    return directory
