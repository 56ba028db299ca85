"""When the consumer watch runs its probes and what it concludes (no broker: the probes are
stubs; a real stuck consumer is in integration_tests/test_liveness.py)."""

from __future__ import annotations

import time

import pytest

from snapline.pipeline.runtime.consumer_watch import ConsumerStuckError, ConsumerWatch


class Probes:
    def __init__(self, answers: bool = True, waiting: int = 0) -> None:
        self.answers = answers
        self.waiting = waiting
        self.calls: list[str] = []

    def broker_answers(self) -> bool:
        self.calls.append("broker")
        return self.answers

    def records_waiting(self) -> int:
        self.calls.append("records")
        return self.waiting


def check(watch: ConsumerWatch, now: float, probes: Probes, fetching: bool = True) -> None:
    watch.check(now, fetching, probes.broker_answers, probes.records_waiting)


def test_nothing_is_probed_within_the_limit() -> None:
    watch = ConsumerWatch(10.0)
    probes = Probes(waiting=5)
    check(watch, time.monotonic() + 5, probes)
    watch.assigned()
    check(watch, time.monotonic() + 5, probes)
    assert probes.calls == []


def test_no_assignment_past_the_limit_with_the_broker_answering_is_stuck() -> None:
    watch = ConsumerWatch(10.0)
    with pytest.raises(ConsumerStuckError, match="no partition assignment for 1[0-9]s"):
        check(watch, time.monotonic() + 11, Probes())


def test_no_assignment_during_an_outage_waits_a_whole_limit_again() -> None:
    watch = ConsumerWatch(10.0)
    probes = Probes(answers=False)
    later = time.monotonic() + 11
    check(watch, later, probes)
    check(watch, later + 5, probes)  # within the limit counted from the probe
    assert probes.calls == ["broker"]
    probes.answers = True
    with pytest.raises(ConsumerStuckError):
        check(watch, later + 11, probes)


def test_a_fetch_gap_is_stuck_only_while_records_wait() -> None:
    watch = ConsumerWatch(10.0)
    watch.assigned()
    probes = Probes(waiting=0)
    later = time.monotonic() + 11
    check(watch, later, probes)  # an idle input: nothing waits
    assert probes.calls == ["records"]
    probes.waiting = 7
    with pytest.raises(ConsumerStuckError, match="7 committed records wait"):
        check(watch, later + 11, probes)


def test_a_fetch_gap_does_not_count_while_not_fetching_or_after_a_fetch() -> None:
    watch = ConsumerWatch(10.0)
    watch.assigned()
    probes = Probes(waiting=7)
    start = time.monotonic()
    check(watch, start + 11, probes, fetching=False)  # paused, or no tasks
    watch.fetched(start + 15)
    check(watch, start + 20, probes)
    assert probes.calls == []
