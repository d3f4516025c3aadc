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


@dataclass
class PeakMemory:
    """`with PeakMemory() as peak: ...` then `peak.rss_bytes` (peak RSS above the RSS at entry,
    None where the OS cannot tell) and `peak.cuda_bytes` (peak CUDA allocation above entry)."""

    rss_bytes: int | None = None
    cuda_bytes: int | None = None
    _rss_start: int | None = field(default=None, repr=False)
    _cuda_start: int = field(default=0, repr=False)

    def __enter__(self) -> "PeakMemory":
        gc.collect()  # garbage freed later would hide new allocations behind a too-high start
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM, the peak RSS, to the current RSS
            self._rss_start = _status_kib("VmRSS")
        except OSError:
            self._rss_start = None
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._cuda_start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc) -> None:
        peak = _status_kib("VmHWM")
        if self._rss_start is not None and peak is not None:
            self.rss_bytes = max(0, peak - self._rss_start) * 1024
        if torch.cuda.is_available():
            self.cuda_bytes = torch.cuda.max_memory_allocated() - self._cuda_start

    def to_json(self) -> dict:
        return {"rss_bytes": self.rss_bytes, "cuda_bytes": self.cuda_bytes}
