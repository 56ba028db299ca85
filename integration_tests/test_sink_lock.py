"""A PostgreSQL sink whose database is down, or whose rows its writer cannot lock.

A sink table locked by someone else (an ``ALTER TABLE``, a ``VACUUM FULL``, a
long transaction holding ``ACCESS EXCLUSIVE``) while the job runs: the apply of a committed
checkpoint waits for the lock. The worker must not hang silently: the liveness watchdog ends
it, printing where it waited; once the lock is gone, a restart applies what was committed and
every sink holds every input exactly once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import psycopg
import pytest

from examples.workers import WorkerProcess, process_state
from integration_tests.warehouse_job import WarehouseJob, wait_for
from snapline.connectors.local.postgres import LocalPostgres

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


def _frozen_at(worker: WorkerProcess, point: str) -> bool:
    """The worker passed the fault point ``point`` and is stopped (SIGSTOP) there."""
    assert worker.proc is not None
    if not worker.fault_log.exists():
        return False
    hit = any(
        line.split()[1:] == [str(worker.proc.pid), point]
        for line in worker.fault_log.read_text().splitlines()
    )
    return hit and process_state(worker.proc.pid) == "T"


def test_a_writer_frozen_inside_its_apply_does_not_hold_the_next_owner(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    """A worker committed a checkpoint in Kafka and froze (SIGSTOP, a paused VM) inside the
    PostgreSQL transaction that applies it, holding that checkpoint's lock and the rows'.
    Past its session timeout the other worker takes its partitions, restores that checkpoint
    and applies it: it waited on those locks for as long as the frozen one stayed frozen
    (PostgreSQL keeps an idle session; a stopped process's kernel still answers TCP), until
    its liveness watchdog ended it, again and again. The writer's session now ends after
    ``IDLE_IN_TRANSACTION_TIMEOUT`` (30 s) idle in a transaction, its apply rolls back, and the
    new owner's goes through. Woken, the frozen worker's commit fails and it exits; every
    input is in every sink exactly once."""
    job = WarehouseJob(kafka_bootstrap, unique_name, tmp_path, postgres_dsn, interval=0.3)
    jobs.append(job)
    frozen, owner = job.workers
    frozen.start({"SNAPLINE_FAULT": "mid_sink_apply:1:stop"})
    job.produce(1000)
    wait_for("a worker frozen in its apply", lambda: _frozen_at(frozen, "mid_sink_apply"), 90)
    owner.start()
    # session timeout (10 s), the restore, then the apply: the frozen session ends after
    # 30 s idle. Before, the apply waited until the frozen worker woke.

    def applied() -> bool:
        db = job.database()
        return {c: t for c, (t, _) in db.items()} == job.expected and (
            sum(n for _, n in db.values()) == job.produced
        )

    wait_for("the new owner's apply of every order", applied, 120, job.logs)
    frozen.signal(signal.SIGCONT)
    code = frozen.wait_exit(60)
    assert code != 0, frozen.tail()
    job.produce(500)
    job.wait_until_caught_up()
    owner.stop()
    job.verify()


def test_a_database_outage_is_waited_out_by_restarts_and_loses_nothing(
    kafka_bootstrap: str,
    own_postgres: LocalPostgres,
    tmp_path: Path,
    unique_name: str,
    jobs: list,
) -> None:
    """The database goes down while the job runs. The worker's checkpoint fails and so does
    its recovery of the sink: it exits with EX_TEMPFAIL (75), which a supervisor restarts
    with backoff without counting a crash (before: exit 1, so six restarts within a minute's
    outage stopped the whole job). Restarted once the database is back, it publishes what
    was committed, and every input is in every sink exactly once."""
    job = WarehouseJob(
        kafka_bootstrap, unique_name, tmp_path, own_postgres.dsn, workers=1, interval=0.3
    )
    jobs.append(job)
    (worker,) = job.workers
    worker.start()
    job.produce(500)
    job.wait_until_caught_up()
    own_postgres.stop(keep_data=True)
    try:
        job.produce(500)
        # the next checkpoint's staging fails, then the sink's recovery: well within 90 s
        code = worker.wait_exit(90)
    finally:
        own_postgres.start()
    text = worker.log_path.read_text(errors="replace")
    assert code == 75 and "once the sink answers" in text, worker.tail()
    worker.start()
    job.produce(500)
    job.wait_until_caught_up()
    worker.stop()
    job.verify()
