"""How a worker handles the control channel's requests (Worker._poll_control), pure logic on
a stand-in with the fields it reads: a request found in progress at start, whose savepoint
was written before the worker had its tasks, is dropped when its resume comes (the worker
does not pause afterwards for a savepoint that is over), and the partitions it paused at the
assignment go on."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from snapline.pipeline.runtime.worker import Worker
from snapline.pipeline.savepoint.control import Request


def _worker(polls: list[list[Request]]) -> Any:
    calls: list[str] = []
    worker = SimpleNamespace(
        _control=SimpleNamespace(poll=lambda: polls.pop(0) if polls else []),
        _savepoint_request=None,
        _paused=None,
        _paused_at=0.0,
        _pause_limit=300.0,
        _assigned=False,
        _restore_pending=False,
        consumer=SimpleNamespace(
            assignment=lambda: ["p0"], resume=lambda parts: calls.append(f"resume {parts}")
        ),
        calls=calls,
    )
    worker._take_savepoint = lambda request: calls.append(f"take {request.id}")
    return worker


def test_a_request_found_at_start_and_resumed_before_the_assignment_is_dropped() -> None:
    found = Request("sp1", "savepoint", heard=time.monotonic() - 10)
    worker = _worker([[found], [Request("sp1", "resume")]])
    Worker._poll_control(worker)  # not assigned yet: kept for later
    assert worker._savepoint_request == found and worker.calls == []
    Worker._poll_control(worker)
    worker._assigned = True
    Worker._poll_control(worker)
    assert worker._savepoint_request is None
    assert worker.calls == ["resume ['p0']"], "taken after its resume, or left paused"


def test_a_request_found_at_start_is_taken_once_the_tasks_are_restored() -> None:
    found = Request("sp2", "savepoint", heard=time.monotonic() - 10)
    worker = _worker([[found]])
    Worker._poll_control(worker)
    worker._assigned = True
    Worker._poll_control(worker)
    assert worker.calls == ["take sp2"] and worker._savepoint_request is None
