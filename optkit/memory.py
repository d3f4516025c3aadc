"""Peak memory of a block of work: resident set (Linux) and CUDA allocations, as deltas."""

import gc
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int | None:
    try:
        match = re.search(rf"{key}:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        return None
    return int(match.group(1)) if match else None


_OPEN: list["PeakMemory"] = []  # windows entered and not yet left, outermost first


@dataclass
class PeakMemory:
    """`with PeakMemory() as peak: ...` then `peak.rss_bytes` (peak RSS above the RSS at entry,
    None where the OS cannot tell) and `peak.cuda_bytes` (peak CUDA allocation above entry).

    Windows nest (a benchmark's around `quantize_model`'s own): the process has one peak
    counter of each kind, so entering a window first hands the peaks so far to the open ones."""

    rss_bytes: int | None = None
    cuda_bytes: int | None = None
    _rss_start: int | None = field(default=None, repr=False)
    _cuda_start: int = field(default=0, repr=False)
    _rss_peak_kib: int = field(default=0, repr=False)  # peaks seen before an inner window's reset
    _cuda_peak: int = field(default=0, repr=False)

    def __enter__(self) -> "PeakMemory":
        gc.collect()  # garbage freed later would hide new allocations behind a too-high start
        rss_peak = _status_kib("VmHWM") or 0
        cuda_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        for window in _OPEN:
            window._rss_peak_kib = max(window._rss_peak_kib, rss_peak)
            window._cuda_peak = max(window._cuda_peak, cuda_peak)
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM, the peak RSS, to the current RSS
            self._rss_start = _status_kib("VmRSS")
        except OSError:
            self._rss_start = None
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
        _OPEN.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _OPEN.remove(self)
        peak = _status_kib("VmHWM")
        if self._rss_start is not None and peak is not None:
            self.rss_bytes = max(0, max(peak, self._rss_peak_kib) - self._rss_start) * 1024
        if torch.cuda.is_available():
            self.cuda_bytes = max(torch.cuda.max_memory_allocated(), self._cuda_peak) - self._cuda_start

    def to_json(self) -> dict:
        return {"rss_bytes": self.rss_bytes, "cuda_bytes": self.cuda_bytes}
