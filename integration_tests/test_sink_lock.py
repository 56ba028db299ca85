"""A PostgreSQL sink table locked by someone else (an ``ALTER TABLE``, a ``VACUUM FULL``, a
long transaction holding ``ACCESS EXCLUSIVE``) while the job runs: the apply of a committed
checkpoint waits for the lock. The worker must not hang silently: the liveness watchdog ends
it, printing where it waited; once the lock is gone, a restart applies what was committed and
every sink holds every input exactly once.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from integration_tests.warehouse_job import WarehouseJob

pytestmark = [pytest.mark.integration, pytest.mark.postgres]


def test_a_locked_sink_table_ends_the_worker_and_a_restart_loses_nothing(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        workers=1,
        interval=0.3,
        extra_env={"SNAPLINE_LIVENESS_TIMEOUT": "10"},
    )
    jobs.append(job)
    (worker,) = job.workers
    worker.start()
    job.produce(500)
    job.wait_until_caught_up()
    with psycopg.connect(postgres_dsn) as locker:
        locker.execute(f"LOCK TABLE {job.pg_table} IN ACCESS EXCLUSIVE MODE")
        job.produce(500)
        # the apply waits for the lock; the watchdog ends the worker 10 s
        # after the task thread's last beat
        code = worker.wait_exit(60)
        locker.rollback()
    text = worker.log_path.read_text(errors="replace")
    assert code == 75 and "the task thread made no progress" in text, worker.tail()
    assert "in _apply" in text, "the stacks do not show the apply waiting for the lock"
    worker.start()
    job.produce(500)
    job.wait_until_caught_up()
    worker.stop()
    job.verify()
