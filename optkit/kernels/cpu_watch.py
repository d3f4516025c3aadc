"""models/derived.py's per-step check in C++ (cpu_watch.cpp): whether every watched slot still holds
its object, every watched tensor its storage and version, and whether a watched module has a forward
hook; the same answers as the Python loops, with the cache misses of a cold check in flight together.

Built at first use into $OPTKIT_CACHE/kernels (kernels/cpp_build.py) as a Python module; where it
cannot be built, or with OPTKIT_CPU_WATCH=0 (A/B runs), `watch` returns None and models/derived.py
keeps its Python loops.
"""

import functools
import os
from pathlib import Path
from types import ModuleType

from optkit.kernels import cpp_build

SOURCE = Path(__file__).with_name("cpu_watch.cpp")


@functools.cache
def _module() -> tuple[ModuleType | None, str]:
    if os.environ.get("OPTKIT_CPU_WATCH", "") == "0":
        return None, "OPTKIT_CPU_WATCH=0"
    return cpp_build.load_module(SOURCE, "optkit_cpu_watch")


def unavailable_reason() -> str:
    """An empty string when the C++ check runs here; otherwise why not (built once per process)."""
    return _module()[1]


def watch(holders: list, names: list, held: list, tensors: list, versioned: list, modules: list):
    """The C++ Watch of these slots (holder dicts, names, the objects held), tensors (their data
    pointers; `versioned` also their versions) and modules (their hooks), with `stands()` and
    `hooked()`; None where the library does not run."""
    module = _module()[0]
    return None if module is None else module.Watch(holders, names, held, tensors, versioned, modules)
