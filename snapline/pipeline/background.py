"""Background jobs of a worker (checkpoint materialization, retention, history) whose
shutdown is bounded.

A job may block for good: a checkpoint storage write on a hung mount, or a request without
a timeout. ``ThreadPoolExecutor.shutdown(wait=True)`` would then never return, and neither
would a normal interpreter exit, which joins every pool thread. ``BackgroundJobs.shutdown``
waits at most its bound and names the jobs still running; a process that has any left must
end with ``os._exit``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

#: Seconds ``shutdown`` waits for queued and running jobs by default.
SHUTDOWN_BOUND = 10.0


class BackgroundJobs:
    """A thread pool that knows, for each job not yet done, what it is and since when it
    runs."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        #: Jobs submitted and not done: what each is, and when it began to run (None: queued).
        self._jobs: dict[Future[Any], tuple[str, float | None]] = {}
        self._lock = threading.Lock()

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` in the pool; ``what`` names it if it outlives ``shutdown``."""
        future: Future[Any]

        def job() -> Any:
            # The lock is held until ``future`` is assigned below.
            with self._lock:
                self._jobs[future] = (what, time.monotonic())
            return fn(*args)

        with self._lock:
            future = self._pool.submit(job)
            self._jobs.setdefault(future, (what, None))
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future[Any]) -> None:
        with self._lock:
            self._jobs.pop(future, None)

    def shutdown(self, bound: float = SHUTDOWN_BOUND) -> list[str]:
        """Let queued and running jobs finish for at most ``bound`` seconds; return the ones
        still not done, e.g. "checkpoint 7 of task p0 (running 31 s)"."""
        self._pool.shutdown(wait=False, cancel_futures=False)
        with self._lock:
            futures = list(self._jobs)
        wait(futures, timeout=bound)
        now = time.monotonic()
        with self._lock:
            # ``wait`` returns once a future is done, which is before its done callbacks
            # (``_done``) have run: a finished job may still be listed, so ask each future.
            left = [job for future, job in self._jobs.items() if not future.done()]
        return [
            f"{what} ({'queued' if began is None else f'running {now - began:.0f} s'})"
            for what, began in left
        ]
