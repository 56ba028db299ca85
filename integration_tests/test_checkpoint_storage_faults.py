"""Checkpoint storage that is full, flaky or slow (issue 9 item 8), on real processes.

The worker's checkpoint storage is a real directory whose writes a test can make fail
(``SNAPLINE_TEST_STORAGE_FAULTS`` names a control file: ``full`` fails every write with ENOSPC,
``flaky`` every other one, ``slow <s>`` delays each). Processing continues while checkpoints
fail, up to ``tolerable_failed_checkpoints`` in a row; when storage heals, checkpoints resume
by themselves; past the tolerance the worker stops with a message naming the storage error.
Storage that hangs fails each checkpoint at ``checkpoint_timeout``, and the worker still ends
past the tolerance instead of waiting for the hung writes.
Every sink holds every input exactly once at the end.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from examples.workers import WorkerProcess, read_events
from integration_tests.warehouse_job import WarehouseJob, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.postgres]


def _events(job: WarehouseJob, kind: str, since: float = 0.0) -> list[dict]:
    return [
        e
        for e in read_events(job.workers[0].metrics_path)
        if e["event"] == kind and e["time"] > since
    ]


def _started_job(
    kafka_bootstrap: str,
    postgres_dsn: str,
    tmp_path: Path,
    unique_name: str,
    jobs: list,
    tolerable: int,
    env: dict[str, str] | None = None,
) -> tuple[WarehouseJob, WorkerProcess, Path]:
    """One worker whose storage faults the returned control file sets, caught up with 2,000
    orders."""
    control = tmp_path / "storage-faults"
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        workers=1,
        interval=0.3,
        tolerable=tolerable,
        extra_env={"SNAPLINE_TEST_STORAGE_FAULTS": str(control), **(env or {})},
    )
    jobs.append(job)
    (worker,) = job.workers
    worker.start()
    job.produce(2000)
    job.wait_until_caught_up()
    return job, worker, control


def _heal_restart_and_verify(job: WarehouseJob, worker: WorkerProcess, control: Path) -> None:
    """Storage healed: a restart resumes from the last committed checkpoint, losing and
    duplicating nothing."""
    control.write_text("")
    worker.start()
    job.produce(500)
    job.wait_until_caught_up()
    worker.stop()
    job.verify()


def test_processing_continues_while_storage_fails_and_checkpoints_resume(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    job, worker, control = _started_job(
        kafka_bootstrap, postgres_dsn, tmp_path, unique_name, jobs, 1000
    )

    for mode in ("full", "flaky"):
        control.write_text(mode)
        broke = time.time()
        for _ in range(10):  # input keeps arriving while storage refuses writes
            job.produce(300)
            time.sleep(0.4)
        failed = _events(job, "checkpoint_failed", broke)
        assert len(failed) >= 3 and all(e.get("continued") for e in failed), failed[:3]
        assert worker.alive, worker.tail()
        assert failed[-1]["records_in"] > failed[0]["records_in"], (
            f"nothing was processed while {mode} storage refused checkpoints"
        )
        control.write_text("")
        healed = time.time()
        wait_for(
            f"checkpoints resuming after {mode} storage",
            lambda since=healed: _events(job, "checkpoint", since),
            60,
            worker.tail,
        )
        job.wait_until_caught_up()
    worker.stop()
    job.verify()


def test_storage_full_past_the_tolerance_stops_the_worker_naming_the_error(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    job, worker, control = _started_job(
        kafka_bootstrap, postgres_dsn, tmp_path, unique_name, jobs, 3
    )
    control.write_text("full")
    job.produce(500)
    assert worker.wait_exit(60) != 0
    tail = worker.tail()
    assert "tolerable_failed_checkpoints=3" in tail and "No space left on device" in tail, tail
    assert str(job.checkpoint_dir) in tail, "the message does not name the storage"
    _heal_restart_and_verify(job, worker, control)


def test_hung_storage_fails_checkpoints_at_the_timeout_and_ends_the_worker(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    """A storage write that never returns (a hung mount): each checkpoint fails at
    ``checkpoint_timeout``, and past the tolerance the worker ends, naming the timeout,
    although the hung writes still hold threads. If instead the restore after the first
    failure hangs (it writes the committed marker of a checkpoint whose marker the hung pool
    never wrote), the liveness watchdog ends it, naming the write in the stacks it prints.
    Either way it ends; healed, a restart loses and duplicates nothing."""
    job, worker, control = _started_job(
        kafka_bootstrap,
        postgres_dsn,
        tmp_path,
        unique_name,
        jobs,
        1,
        {"SNAPLINE_EXAMPLE_CHECKPOINT_TIMEOUT": "3", "SNAPLINE_LIVENESS_TIMEOUT": "15"},
    )
    control.write_text("slow 3600")  # every write blocks for an hour
    hung = time.time()
    job.produce(500)
    # 2 checkpoints of 3 s each, their recoveries (backoff 1 s, 2 s): well within 60 s.
    code = worker.wait_exit(60)
    assert code not in (None, 0), worker.tail()
    text = worker.log_path.read_text(errors="replace")
    if code == 1:  # past the tolerance
        assert "tolerable_failed_checkpoints=1" in text, worker.tail()
        assert "did not complete within 3" in text, worker.tail()
        assert len(_events(job, "checkpoint_failed", hung)) >= 2, worker.tail()
    else:  # the watchdog: a restore hung on a write
        assert code == 75 and "the task thread made no progress" in text, worker.tail()
        assert "_before_write" in text and "did not complete within 3" in text, worker.tail()
    _heal_restart_and_verify(job, worker, control)
