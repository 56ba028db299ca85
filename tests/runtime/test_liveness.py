"""The task thread's liveness deadline and its watchdog (no broker; the watchdog's stall
action is replaced by a recorder, so nothing exits). A real stalled worker process is in
integration_tests/test_liveness.py."""

from __future__ import annotations

import threading
import time

import pytest

from snapline.pipeline.runtime.kafka_calls import BoundedCall
from snapline.pipeline.runtime.liveness import (
    CHECK_INTERVAL,
    DEFAULT_TIMEOUT,
    Liveness,
    Watchdog,
    check_timeout,
)


class Stalls:
    """Records the watchdog's calls instead of ending the process."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []
        self.called = threading.Event()

    def __call__(self, silent_for: float, timeout: float) -> None:
        self.calls.append((silent_for, timeout))
        self.called.set()


def test_a_beat_moves_the_deadline_by_the_timeout() -> None:
    liveness = Liveness(10.0)
    before = time.monotonic()
    liveness.beat()
    assert before + 10.0 <= liveness.deadline <= time.monotonic() + 10.0


def test_allow_covers_a_bounded_wait_and_never_shortens_the_deadline() -> None:
    liveness = Liveness(10.0)
    before = time.monotonic()
    liveness.allow(100.0)
    assert liveness.deadline >= before + 110.0
    far = liveness.deadline
    liveness.allow(1.0)
    assert liveness.deadline == far


def test_a_bounded_call_tells_liveness_its_bound() -> None:
    liveness = Liveness(10.0)
    call = BoundedCall("producer", liveness)
    before = time.monotonic()
    assert call("flush", 50.0, lambda: 1) == 1
    assert liveness.deadline >= before + 60.0


@pytest.mark.parametrize(
    ("timeout", "ok"),
    [(0, True), (5, True), (DEFAULT_TIMEOUT, True), (4.9, False), (-1, False), (86_401, False)],
)
def test_check_timeout(timeout: float, ok: bool) -> None:
    problem = check_timeout(timeout)
    assert (problem is None) == ok
    if problem:
        assert "0 (off)" in problem and str(timeout) in problem


def test_the_watchdog_calls_on_stall_once_the_deadline_passed() -> None:
    liveness = Liveness(0.5)
    stalls = Stalls()
    watchdog = Watchdog(liveness, stalls, backstop=False)
    started = time.monotonic()
    watchdog.start()
    try:
        # Bounded: the deadline is 0.5 s away and the watchdog looks every CHECK_INTERVAL.
        assert stalls.called.wait(0.5 + 3 * CHECK_INTERVAL), "no stall reported"
    finally:
        watchdog.stop()
    assert len(stalls.calls) == 1
    silent_for, timeout = stalls.calls[0]
    assert timeout == 0.5
    assert 0.5 <= silent_for <= time.monotonic() - started + 0.5


def test_the_watchdog_leaves_a_beating_thread_alone() -> None:
    liveness = Liveness(3.0)  # a beat every 50 ms: a stall of the test of 3 s would be one
    stalls = Stalls()
    watchdog = Watchdog(liveness, stalls, backstop=False)
    watchdog.start()
    try:
        end = time.monotonic() + 3 * CHECK_INTERVAL + 3.0  # several looks past one timeout
        while time.monotonic() < end:
            liveness.beat()
            time.sleep(0.05)
    finally:
        watchdog.stop()
    assert stalls.calls == []
