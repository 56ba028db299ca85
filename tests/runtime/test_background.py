"""Background jobs whose shutdown is bounded: a job that never returns (a write on a hung
mount) is named instead of blocking the worker's exit forever."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from snapline.pipeline.background import BackgroundJobs


def test_shutdown_waits_for_jobs_that_end() -> None:
    jobs = BackgroundJobs(2, "test")
    done: list[int] = []
    for i in range(5):
        jobs.submit(f"job {i}", lambda i=i: (time.sleep(0.01), done.append(i)))
    assert jobs.shutdown(5.0) == []
    assert sorted(done) == [0, 1, 2, 3, 4]


def test_shutdown_names_a_hung_job_and_the_ones_queued_behind_it() -> None:
    release, running = threading.Event(), threading.Event()
    jobs = BackgroundJobs(1, "test")
    jobs.submit("checkpoint 7 of task p0", lambda: (running.set(), release.wait()))
    jobs.submit("retention of task p0", lambda: None)
    assert running.wait(5)  # the pool thread took the first job (else it is "queued")
    started = time.monotonic()
    left = jobs.shutdown(0.3)
    assert 0.3 <= time.monotonic() - started < 3.0
    assert len(left) == 2, left
    assert left[0].startswith("checkpoint 7 of task p0 (running ") and left[0].endswith(" s)")
    assert left[1] == "retention of task p0 (queued)"
    release.set()  # the thread ends; nothing of it is left to wait for
    assert jobs.shutdown(5.0) == []


def test_a_failed_job_is_done_and_its_error_stays_on_its_future() -> None:
    jobs = BackgroundJobs(1, "test")
    future = jobs.submit("fails", lambda: 1 / 0)
    assert jobs.shutdown(5.0) == []
    assert isinstance(future.exception(), ZeroDivisionError)


def test_a_job_done_before_its_callback_ran_is_not_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``wait`` returns as soon as a future is done, before its done callbacks run; CI once
    # caught shutdown in that gap and named a job that had already failed.
    slow_done = BackgroundJobs._done

    def late(self: BackgroundJobs, future: Future[Any]) -> None:
        time.sleep(0.5)
        slow_done(self, future)

    monkeypatch.setattr(BackgroundJobs, "_done", late)
    jobs = BackgroundJobs(1, "test")
    future = jobs.submit("fails", lambda: 1 / 0)
    assert jobs.shutdown(5.0) == []
    assert isinstance(future.exception(), ZeroDivisionError)
