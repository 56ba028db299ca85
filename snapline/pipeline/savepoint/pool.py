"""Savepoint work spread over processes. The tasks of a savepoint (export) or of a restore
(load) are independent, each with its own checkpoint or key-group range, so a pool of
``spawn`` processes runs them while the calling process works through the same list from the
other end. No ``fork``: RocksDB's background threads would not exist in the child.

Threads: the caller's runs jobs itself; one thread per pool process hands that process jobs
and waits for each. ``progress`` is called from any of them, one call at a time.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)

J = TypeVar("J")
R = TypeVar("R")

#: Below this much state (checkpoint bytes, or savepoint rows) a pool process is not worth
#: starting: it spends ~0.5 s of CPU importing pyarrow and rocksdict, about what the caller
#: needs for this much state alone.
POOL_MIN_BYTES = 32 * 1024 * 1024
POOL_MIN_ROWS = 250_000


def pool_size(
    jobs: int, *, state_bytes: int = 0, rows: int = 0, processes: int | None = None
) -> int:
    """How many processes (the caller's included) should run ``jobs`` jobs over that much
    state: one per CPU when ``processes`` is None, never more than jobs."""
    if processes is None:
        big = state_bytes >= POOL_MIN_BYTES or rows >= POOL_MIN_ROWS
        processes = (os.cpu_count() or 1) if big else 1
    return max(1, min(processes, jobs))


def scratch_options(backend: str, options: dict[str, Any]) -> dict[str, Any]:
    """The state backend options of a scratch backend that a job reads once or bulk-loads."""
    return {**options, "auto_compactions": False} if backend == "rocksdb" else options


def run_jobs(
    fn: Callable[[J], R],
    jobs: Sequence[J],
    processes: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> list[R]:
    """``[fn(job) for job in jobs]`` over ``processes`` processes (this one included); ``fn``
    must be a module-level function and jobs picklable. The first exception stops handing
    out jobs and is raised once the running ones have finished."""
    results: dict[int, R] = {}
    lock = threading.Lock()
    bounds = [0, len(jobs)]  # next job from the front (this process), last one + 1 (the pool)
    failures: list[BaseException] = []

    def take(front: bool) -> int | None:
        with lock:
            if failures or bounds[0] >= bounds[1]:
                return None
            if front:
                bounds[0] += 1
                return bounds[0] - 1
            bounds[1] -= 1
            return bounds[1]

    def finished(index: int, result: R) -> None:
        with lock:
            results[index] = result
            if progress is not None:
                progress(len(results), len(jobs))

    def failed(exc: BaseException) -> None:
        with lock:
            failures.append(exc)

    def feed(pool: ProcessPoolExecutor) -> None:
        while (index := take(front=False)) is not None:
            try:
                finished(index, pool.submit(fn, jobs[index]).result())
            except BaseException as exc:  # noqa: BLE001 - raised by the caller's thread
                failed(exc)

    helpers = max(0, min(processes, len(jobs)) - 1)
    pool = (
        ProcessPoolExecutor(helpers, mp_context=multiprocessing.get_context("spawn"))
        if helpers
        else None
    )
    threads = [
        threading.Thread(target=feed, args=(pool,), name=f"savepoint-pool-{i}", daemon=True)
        for i in range(helpers)
    ]
    try:
        for thread in threads:
            thread.start()
        while (index := take(front=True)) is not None:
            try:
                finished(index, fn(jobs[index]))
            except BaseException as exc:
                failed(exc)
    finally:
        for thread in threads:
            thread.join()
        if pool is not None:
            pool.shutdown(wait=True)
    if failures:
        raise failures[0]
    if helpers:
        log.debug("%d jobs ran in %d processes", len(jobs), helpers + 1)
    return [results[i] for i in range(len(jobs))]
