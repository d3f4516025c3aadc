"""Shadow mode: a sampled fraction of a quantized model's requests is replayed on its full-precision
pair in the background, and both are compared token by token (routing/online.py).

The client never waits for it. A finished request that was sampled is queued (a full queue drops
the replay and counts it); one worker thread replays the queue, at the lowest OS priority, and
only while the server is idle: it starts once no request has been in flight for `idle_s`, and
pauses before every forward step (`chunk_tokens` tokens) while one is. A replay deferred longer
than `max_defer_s` runs anyway, still at the lowest priority, so the numbers stay fresh under
constant load. Scores feed the pair's rolling window (/v1/optkit/shadow), its totals (/metrics)
and its fallback monitor.
"""

import logging
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from optkit.routing import LOGGER
from optkit.routing.config import ShadowOptions
from optkit.routing.fallback import FallbackMonitor
from optkit.routing.online import ShadowScore, total

log = logging.getLogger(LOGGER)
POLL_S = 0.005


@dataclass
class ShadowJob:
    quant: str
    full: str
    request_id: str
    answered_by: str  # quant; full while in fallback
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    queued_at: float = 0.0  # set by submit


# (job, pause) -> score; the scorer calls pause() before each forward step
Scorer = Callable[[ShadowJob, Callable[[], None]], ShadowScore]


class PairStats:
    def __init__(self, quant: str, full: str, window: int):
        self.quant, self.full = quant, full
        self.queued = self.scored = self.dropped = self.failed = 0
        self.total = ShadowScore()
        self.recent: deque[tuple[dict, ShadowScore]] = deque(maxlen=window)

    def add(self, job: ShadowJob, score: ShadowScore, delay_s: float) -> None:
        entry = {
            "request_id": job.request_id,
            "answered_by": job.answered_by,
            "prompt_tokens": job.num_prompt_tokens,
            "output_tokens": len(job.token_ids) - job.num_prompt_tokens,
            **{k: v for k, v in score.json().items() if k != "num_tokens"},
            "scored_at": time.time(),
            "delay_s": round(delay_s, 4),
        }
        self.recent.append((entry, score))
        self.total = self.total + score
        self.scored += 1


class ShadowService:
    def __init__(
        self,
        options: ShadowOptions,
        score: Scorer,
        idle_for: Callable[[], float],
        fallbacks: dict[str, FallbackMonitor] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.rate = options.rate
        self.idle_s, self.max_defer_s = options.idle_s, options.max_defer_s
        self.score, self.idle_for, self.clock = score, idle_for, clock
        self.fallbacks = fallbacks or {}
        self.pairs = {quant: PairStats(quant, full, options.window) for quant, full in options.pairs.items()}
        self.random = random.Random(options.seed)
        self.queue: queue.Queue[ShadowJob | None] = queue.Queue(maxsize=options.max_pending)
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="optkit-shadow", daemon=True)
        self._thread.start()

    def sample(self) -> bool:
        return self.rate > 0 and self.random.random() < self.rate

    def submit(self, job: ShadowJob) -> bool:
        """Queue a replay without waiting; False (and counted as dropped) when the queue is full."""
        pair = self.pairs[job.quant]
        job.queued_at = self.clock()
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            pair.dropped += 1
            return False
        pair.queued += 1
        return True

    def _run(self) -> None:
        _lowest_priority()
        while (job := self.queue.get()) is not None:
            try:
                self._replay(job)
            except Exception:  # a failed replay is counted and logged, never fatal
                self.pairs[job.quant].failed += 1
                log.exception("shadow replay of %s on %s failed", job.request_id, job.full)
            finally:
                self.queue.task_done()

    def _replay(self, job: ShadowJob) -> None:
        self._wait_turn(job)
        score = self.score(job, lambda: self._wait_turn(job))
        with self._lock:
            self.pairs[job.quant].add(job, score, self.clock() - job.queued_at)
        monitor = self.fallbacks.get(job.quant)
        if monitor is not None:
            monitor.observe(score)

    def _wait_turn(self, job: ShadowJob) -> None:
        """Returns once the server has been idle for idle_s, or the job is overdue."""
        while not self._closed:
            if self.idle_for() >= self.idle_s:
                return
            if self.max_defer_s is not None and self.clock() - job.queued_at >= self.max_defer_s:
                return
            time.sleep(POLL_S)

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued replay is scored (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self.queue.get_nowait()
                self.queue.task_done()
            except queue.Empty:
                break
        self.queue.put(None)
        self._thread.join(timeout=10)

    def snapshot(self) -> dict:
        """The rolling windows and totals of every pair, as /v1/optkit/shadow shows them."""
        with self._lock:
            pairs = []
            for quant, pair in self.pairs.items():
                window = total(score for _, score in pair.recent)
                monitor = self.fallbacks.get(quant)
                pairs.append(
                    {
                        "quant": quant,
                        "full": pair.full,
                        "queued": pair.queued,
                        "scored": pair.scored,
                        "dropped": pair.dropped,
                        "failed": pair.failed,
                        "window": window.json() | {"requests": len(pair.recent)},
                        "total": pair.total.json() | {"requests": pair.scored},
                        "requests": [entry for entry, _ in pair.recent],
                        "fallback": monitor.state() if monitor is not None else None,
                    }
                )
        return {"rate": self.rate, "pending": self.queue.qsize(), "pairs": pairs}


def _lowest_priority() -> None:
    """Linux gives each thread its own nice value, and threads it starts (torch's) inherit it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux: run at the normal priority
        pass
