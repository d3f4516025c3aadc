"""The shadow worker (never while a request is in flight, unless overdue) and the fallback monitor."""

import logging
import threading
import time

import pytest

from optkit.routing.config import FallbackOptions, ShadowOptions
from optkit.routing.fallback import FallbackMonitor
from optkit.routing.online import ShadowScore
from optkit.routing.shadow import ShadowJob, ShadowService

GOOD = ShadowScore(num_tokens=10, kld_sum=0.1, top1_matches=10, nll_full_sum=10.0, nll_quant_sum=10.0)
BAD = ShadowScore(num_tokens=10, kld_sum=5.0, top1_matches=5, nll_full_sum=10.0, nll_quant_sum=15.0)


def job(i: int = 0) -> ShadowJob:
    return ShadowJob("q", "f", f"req-{i}", "q", [1, 2, 3, 4], 2)


def monitor(recovery: str = "manual", window: int = 3) -> FallbackMonitor:
    options = FallbackOptions(threshold={"kld": 0.1, "top1": 80}, window=window, recovery=recovery)
    return FallbackMonitor("q", "f", options)


def test_fallback_switches_once_a_full_window_crosses(caplog):
    m = monitor()
    with caplog.at_level(logging.WARNING, logger="optkit.serving"):
        m.observe(BAD)
        m.observe(BAD)
        assert not m.active  # the window is not full yet
        m.observe(GOOD)
    assert m.active and m.switches == {"full": 1, "quant": 0}
    message = "requests for q now go q -> f: kld_mean 0.3367 > 0.1, top1_pct 66.67 < 80 over the last 3 shadowed"
    assert message in caplog.text
    state = m.state()
    assert state["serving"] == "f" and state["window"]["requests"] == 0  # restarted at the switch
    assert state["events"][-1]["to"] == "full" and "kld_mean" in state["events"][-1]["reason"]
    for _ in range(3):
        m.observe(GOOD)
    assert m.active  # manual recovery: only a reset brings it back
    assert m.reset() and not m.active and m.switches == {"full": 1, "quant": 1}
    assert not m.reset()


def test_fallback_auto_recovery():
    m = monitor("auto", window=2)
    m.observe(BAD), m.observe(BAD)
    assert m.active
    m.observe(GOOD), m.observe(BAD)
    assert m.active  # the window crossed again
    m.observe(GOOD), m.observe(GOOD)
    assert not m.active and m.switches == {"full": 1, "quant": 1}
    m.observe(ShadowScore())  # a request without output tokens counts for nothing
    assert len(m.window) == 0


class Idle:
    def __init__(self):
        self.seconds = 0.0  # 0: a request is in flight

    def __call__(self) -> float:
        return self.seconds


def service(score, idle, **options) -> ShadowService:
    opts = ShadowOptions(pairs={"q": "f"}, rate=1.0, idle_s=0.01, **options)
    return ShadowService(opts, score, idle, {"q": monitor()})


def test_replays_wait_for_idle_and_feed_the_window_and_fallback():
    idle, scored = Idle(), []

    def score(job, pause):
        pause()
        scored.append(job.request_id)
        return BAD

    shadow = service(score, idle, max_defer_s=None)
    try:
        for i in range(3):
            assert shadow.submit(job(i))
        time.sleep(0.1)
        assert scored == []  # busy: nothing replayed
        idle.seconds = 1.0
        assert shadow.drain(timeout=10)
        assert scored == ["req-0", "req-1", "req-2"]
        snapshot = shadow.snapshot()["pairs"][0]
        assert (snapshot["queued"], snapshot["scored"], snapshot["dropped"]) == (3, 3, 0)
        assert snapshot["window"]["kld_mean"] == pytest.approx(0.5) and snapshot["window"]["requests"] == 3
        assert [r["request_id"] for r in snapshot["requests"]] == ["req-0", "req-1", "req-2"]
        assert snapshot["fallback"]["active"] and shadow.fallbacks["q"].active
    finally:
        shadow.close()


def test_a_replay_pauses_between_steps_while_requests_run():
    idle, steps, release = Idle(), [], threading.Event()
    idle.seconds = 1.0

    def score(job, pause):
        for step in range(3):
            pause()
            steps.append(step)
            if step == 0:
                idle.seconds = 0.0  # a request arrives after the first step
                release.set()
        return GOOD

    shadow = service(score, idle, max_defer_s=None)
    try:
        shadow.submit(job())
        release.wait(5)
        time.sleep(0.1)
        assert steps == [0]
        idle.seconds = 1.0
        assert shadow.drain(timeout=10) and steps == [0, 1, 2]
    finally:
        shadow.close()


def test_overdue_replays_run_under_load_and_a_full_queue_drops():
    idle, gate = Idle(), threading.Event()

    def score(job, pause):
        gate.wait(5)
        return GOOD

    shadow = service(score, idle, max_defer_s=0.05, max_pending=2)
    try:
        results = [shadow.submit(job(i)) for i in range(4)]
        assert results.count(False) >= 1  # at most one running and two queued
        gate.set()
        assert shadow.drain(timeout=10)  # overdue: replayed although never idle
        pair = shadow.pairs["q"]
        assert pair.scored == pair.queued == results.count(True) and pair.dropped == results.count(False)
    finally:
        shadow.close()


def test_a_failed_replay_is_counted_not_fatal():
    idle = Idle()
    idle.seconds = 1.0

    def score(job, pause):
        if job.request_id == "req-0":
            raise RuntimeError("boom")
        return GOOD

    shadow = service(score, idle)
    try:
        shadow.submit(job(0)), shadow.submit(job(1))
        assert shadow.drain(timeout=10)
        assert (shadow.pairs["q"].failed, shadow.pairs["q"].scored) == (1, 1)
    finally:
        shadow.close()
