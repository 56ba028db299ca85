"""The savepoint pool: results in job order, the caller's process taking its share, the
first failure raised; pool sizes follow the amount of state."""

from __future__ import annotations

import os

import pytest

from snapline.pipeline.savepoint.pool import POOL_MIN_BYTES, pool_size, run_jobs


def square(n: int) -> tuple[int, int]:
    if n < 0:
        raise ValueError(f"negative {n}")
    return n * n, os.getpid()


def test_results_come_in_job_order_from_both_processes() -> None:
    results = run_jobs(square, list(range(40)), processes=2, threads=1)
    assert [r for r, _ in results] == [n * n for n in range(40)]
    assert os.getpid() in {pid for _, pid in results}


def test_threads_of_this_process_come_first() -> None:
    results = run_jobs(square, list(range(40)), processes=2)
    assert [r for r, _ in results] == [n * n for n in range(40)]
    assert {pid for _, pid in results} == {os.getpid()}
    results = run_jobs(square, list(range(40)), processes=3, threads=2)
    assert [r for r, _ in results] == [n * n for n in range(40)]
    assert os.getpid() in {pid for _, pid in results}


def test_a_failure_in_a_thread_is_raised() -> None:
    with pytest.raises(ValueError, match="negative -3"):
        run_jobs(square, [1, 2, -3, 4, 5, 6], processes=2)


def test_the_first_failure_is_raised() -> None:
    with pytest.raises(ValueError, match="negative -1"):
        run_jobs(square, [1, -1, 2], processes=1)


def test_small_state_stays_in_one_process() -> None:
    assert pool_size(8, state_bytes=1024) == 1
    assert pool_size(8, state_bytes=POOL_MIN_BYTES) == min(8, os.cpu_count() or 1)
    assert pool_size(1, rows=10**9) == 1
    assert pool_size(8, processes=3) == 3
