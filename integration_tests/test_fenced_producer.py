"""A worker whose transactional producer is fenced while it runs, as a survivor fences it when
it aborts the transaction of a worker that was out of the group (runtime/departed.py) and the
worker comes back: the worker replaces the producer and restores in the same process, instead
of exiting. A bounce test found it exiting 75 when the fence landed while it produced: the
next produce raised librdkafka's _FATAL. Every sink holds every input exactly once at the end.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from confluent_kafka import Producer

from integration_tests.warehouse_job import WarehouseJob, wait_for
from snapline.pipeline.runtime.departed import transactional_id

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

ROUNDS = 3


def test_a_worker_fenced_while_it_runs_recovers_in_place_exactly_once(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    job = WarehouseJob(
        kafka_bootstrap, unique_name, tmp_path, postgres_dsn, workers=1, interval=0.3
    )
    jobs.append(job)
    (worker,) = job.workers
    worker.start()
    job.produce(2000)
    job.wait_until_caught_up()
    assert worker.proc is not None
    pid = worker.proc.pid
    log = worker.log_path

    def count(pattern: str) -> int:
        return len(re.findall(pattern, log.read_text(errors="replace")))

    def fence(what: str) -> None:
        before = count("producer cannot go on")
        restores = count("restored from checkpoint")
        fencer = Producer(
            {
                "bootstrap.servers": kafka_bootstrap,
                "transactional.id": transactional_id(unique_name, worker.worker_id),
            }
        )
        fencer.init_transactions(30)  # bumps the epoch: the worker's producer is fenced
        # The worker notices at its next produce or commit (every 0.3 s while input flows).
        wait_for(
            f"{what}: the worker replacing its producer",
            lambda: count("producer cannot go on") > before,
            60,
            worker.tail,
        )
        # The replacement's init_transactions comes before the restore: a fence before it
        # would be undone by it.
        wait_for(
            f"{what}: the worker restoring its tasks",
            lambda: count("restored from checkpoint") > restores,
            60,
            worker.tail,
        )
        assert worker.alive and worker.proc is not None and worker.proc.pid == pid, worker.tail()

    # Input flows during every fence: a worker notices a fence only when it produces or
    # commits, and an idle one checkpoints rarely.
    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            job.produce(20)
            stop.wait(0.05)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        for i in range(ROUNDS):
            fence(f"round {i + 1}, fence 1")
            fence(f"round {i + 1}, fence 2")  # lands on the restore: begin, produce refused
            # A commit before the next round: failed checkpoints in a row count against
            # tolerable_failed_checkpoints (3), a committed one resets the count.
            commits = count(r"checkpoint \d+ committed")
            wait_for(
                f"round {i + 1}: a commit after the fences",
                lambda commits=commits: count(r"checkpoint \d+ committed") > commits,
                60,
                worker.tail,
            )
    finally:
        stop.set()
        feeder.join(30)
    job.wait_until_caught_up()
    assert worker.alive and worker.proc.pid == pid, worker.tail()
    assert count("exit 75") == 0, worker.tail()
    worker.stop()
    job.verify()
