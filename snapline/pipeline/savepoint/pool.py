"""Savepoint work spread over threads and processes. The tasks of a savepoint (export) or of a
restore (load) are independent, each with its own checkpoint or key-group range. The calling
process runs up to ``LOCAL_THREADS`` of them at a time in threads: most of a job is Arrow,
Parquet, zstd, CRC-32 and file I/O, which release the GIL, and threads cost no start-up,
where a pool process spends ~0.6 s of CPU importing pyarrow and rocksdict. Beyond those, a
pool of ``spawn`` processes works through the same list from the other end. No ``fork``:
RocksDB's background threads would not exist in the child.

Threads: the caller's and ``LOCAL_THREADS - 1`` more run jobs in this process, each job on one
thread from start to end (its scratch backend is that thread's alone); one thread per pool
process hands that process jobs and waits for each. ``progress`` is called from any of them,
one call at a time.
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

#: Below this much state (checkpoint bytes, or savepoint rows) one job at a time does: a
#: second thread, or a pool process (~0.6 s of CPU importing pyarrow and rocksdict), gains
#: little on what the caller needs for this much state alone.
POOL_MIN_BYTES = 32 * 1024 * 1024
POOL_MIN_ROWS = 250_000
#: Jobs the calling process runs at a time. Two, not one per CPU: a rocksdb job iterates its
#: database or writes its SST file entry by entry holding the GIL (about half of its CPU
#: time), so a third thread would mostly wait; further CPUs get pool processes. Measured on
#: 2 CPUs (1M keys): two threads used 0.6-1.1 s less CPU than the caller and one process.
LOCAL_THREADS = 2


def pool_size(
    jobs: int, *, state_bytes: int = 0, rows: int = 0, processes: int | None = None
) -> int:
    """How many jobs should run at a time over that much state (threads of the caller's
    process first, then pool processes, see ``run_jobs``): one per CPU when ``processes`` is
    None, never more than jobs."""
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
    *,
    threads: int = LOCAL_THREADS,
) -> list[R]:
    """``[fn(job) for job in jobs]``, ``processes`` jobs at a time: up to ``threads`` of them
    in this process, the others each in a pool process. ``fn`` must be a module-level
    function and jobs picklable. The first exception stops handing out jobs and is raised
    once the running ones have finished."""
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

    def work() -> None:
        while (index := take(front=True)) is not None:
            try:
                finished(index, fn(jobs[index]))
            except BaseException as exc:  # noqa: BLE001 - raised by the caller's thread
                failed(exc)

    at_once = max(1, min(processes, len(jobs)))
    local = max(1, min(threads, at_once))
    helpers = at_once - local
    pool = (
        ProcessPoolExecutor(helpers, mp_context=multiprocessing.get_context("spawn"))
        if helpers
        else None
    )
    workers = [
        threading.Thread(target=feed, args=(pool,), name=f"savepoint-pool-{i}", daemon=True)
        for i in range(helpers)
    ] + [
        threading.Thread(target=work, name=f"savepoint-job-{i}", daemon=True)
        for i in range(1, local)
    ]
    try:
        for thread in workers:
            thread.start()
        work()
    finally:
        for thread in workers:
            thread.join()
        if pool is not None:
            pool.shutdown(wait=True)
    if failures:
        raise failures[0]
    if at_once > 1:
        log.debug("%d jobs ran in %d threads and %d processes", len(jobs), local, helpers)
    return [results[i] for i in range(len(jobs))]
