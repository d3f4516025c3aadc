"""Fallback: when a quantized model's online quality crosses the threshold over the last `window`
shadowed requests, its new requests go to its full-precision pair, until an operator resets it
(POST /v1/optkit/fallback/reset) or, with `recovery: auto`, a full window passes again.

While in fallback, sampled requests are still shadowed (FULL's answers, scored the same way: both
models teacher-forced on them), so the window keeps measuring QUANT. Requests already running on
QUANT finish there: a switch only changes where new requests go. The window restarts at each
switch. Every switch is logged (logger `optkit.serving`, `routing.LOGGER`) and counted.
"""

import logging
import threading
import time
from collections import deque

from optkit.routing import LOGGER
from optkit.routing.config import FallbackOptions
from optkit.routing.online import ShadowScore, crossed, gate_thresholds, total

log = logging.getLogger(LOGGER)
MAX_EVENTS = 100


class FallbackMonitor:
    def __init__(self, quant: str, full: str, options: FallbackOptions, clock=time.time):
        assert options.threshold is not None
        self.quant, self.full = quant, full
        self.window_size = options.window
        self.recovery = options.recovery
        t = options.threshold
        self.thresholds = gate_thresholds(t.kld, t.top1, t.ppl_increase)
        self.clock = clock
        self.active = False
        self.switches = {"full": 0, "quant": 0}  # switches to full precision, and back
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self.window: deque[ShadowScore] = deque(maxlen=options.window)
        self._lock = threading.Lock()

    def observe(self, score: ShadowScore) -> None:
        """One shadowed request's score (from the shadow worker's thread)."""
        if score.num_tokens == 0:
            return
        with self._lock:
            self.window.append(score)
            if len(self.window) < self.window_size:
                return
            failed = crossed(total(self.window), self.thresholds)
            if failed and not self.active:
                self._switch(True, f"{', '.join(failed)} over the last {self.window_size} shadowed requests")
            elif not failed and self.active and self.recovery == "auto":
                self._switch(False, f"the last {self.window_size} shadowed requests are within the threshold")

    def reset(self, by: str = "operator") -> bool:
        """Back to QUANT; True if it was in fallback."""
        with self._lock:
            if not self.active:
                self.window.clear()
                return False
            self._switch(False, f"reset by the {by}")
            return True

    def _switch(self, to_full: bool, reason: str) -> None:
        self.active = to_full
        target = "full" if to_full else "quant"
        self.switches[target] += 1
        self.window.clear()
        event = {"at": self.clock(), "quant": self.quant, "full": self.full, "to": target, "reason": reason}
        self.events.append(event)
        route = f"{self.quant} -> {self.full}" if to_full else f"{self.full} -> {self.quant}"
        log.warning("fallback: requests for %s now go %s: %s", self.quant, route, reason)

    def state(self) -> dict:
        with self._lock:
            window = total(self.window).json() | {"requests": len(self.window), "size": self.window_size}
            return {
                "quant": self.quant,
                "full": self.full,
                "active": self.active,
                "serving": self.full if self.active else self.quant,
                "recovery": self.recovery,
                "threshold": {k: v for k, v in self.thresholds.model_dump().items() if v is not None},
                "window": window,
                "switches": dict(self.switches),
                "events": list(self.events),
            }
