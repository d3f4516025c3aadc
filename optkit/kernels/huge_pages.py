"""Weights a CPU decode step streams, kept in 2 MiB pages where Linux gives them.

A decode step at batch 1 reads every weight byte once, in many short streams (a small model's linear
is 0.1-1 MB). With 4 KiB pages each stream crosses a page every 4 KiB: a TLB miss, and a boundary
the hardware prefetchers do not cross, so each page starts its stream cold again. In 2 MiB pages the
same kernels read the same bytes faster (bench/cpu_decode_switches.py). The bytes and the results are
the same: only where the memory lies changes.

`copy_in(t)` returns a contiguous copy of a CPU tensor placed in an arena of anonymous mappings
aligned to 2 MiB and advised MADV_HUGEPAGE (transparent huge pages in `madvise` or `always` mode);
consecutive copies lie next to each other, so a model's weights packed layer by layer lie in the order
a decode step reads them. Elsewhere (not Linux, transparent huge pages off, OPTKIT_HUGE_PAGES=0) it
returns `t.contiguous()`. The arena is for weights that live as long as their model: a mapping is
unmapped once no tensor placed in it is left, and the arena keeps only the mapping it is filling.
"""

import functools
import mmap
import os
import sys
import threading
from pathlib import Path

import torch

PAGE = 2 << 20  # bytes of a transparent huge page on x86-64
CHUNK = 32 << 20  # bytes the arena maps at a time (more for a larger tensor)
ALIGN = 64  # each copy starts on a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def unavailable_reason() -> str:
    """An empty string where copies go to huge pages; otherwise why not."""
    if os.environ.get("OPTKIT_HUGE_PAGES", "1") == "0":
        return "OPTKIT_HUGE_PAGES=0"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not Linux"
    try:
        mode = THP_MODE.read_text()
    except OSError:
        return "no transparent huge pages"
    if "[never]" in mode:
        return "transparent huge pages are off"
    return ""


class _Arena:
    def __init__(self):
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None  # uint8, the 2 MiB-aligned part of the mapping being filled
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """nbytes of uint8 from the arena (a fresh mapping where the current one lacks room)."""
        with self._lock:
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._chunk, self._used = _mapping(max(CHUNK, -(-nbytes // PAGE) * PAGE)), 0
            start = self._used
            self._used = -(-(start + nbytes) // ALIGN) * ALIGN
            return self._chunk[start : start + nbytes]


def _mapping(nbytes: int) -> torch.Tensor:
    """A 2 MiB-aligned view of nbytes in a new anonymous mapping advised MADV_HUGEPAGE (one page more
    is mapped so that an aligned start lies inside; untouched, it takes no memory). The tensor keeps
    the mapping alive."""
    mapped = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)
    offset = -whole.data_ptr() % PAGE
    try:
        mapped.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except OSError:  # refused (a kernel without it): the same memory in 4 KiB pages
        pass
    return whole[offset : offset + nbytes]


_arena = _Arena()


def copy_in(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor `t` in huge pages (see the module's docstring), or
    `t.contiguous()` where there are none."""
    if t.device.type != "cpu" or unavailable_reason() or t.numel() == 0:
        return t.contiguous()
    placed = _arena.take(t.numel() * t.element_size()).view(t.dtype).view(t.shape)
    placed.copy_(t)
    return placed
