"""A worker's local state directory belongs to that worker alone (runtime/local_lock.py).

Workers given the same ``--local-dir`` (one ``SNAPLINE_LOCAL_DIR`` for every service on a
host, or ``snapline run --workers 2 --local-dir D``) used to share ``D/<job>/<task>``: at a
rebalance each worker deleted the task directories it did not own, i.e. the other worker's
live RocksDB files, and both crashed at their next checkpoint. A second process with a
worker's id on the same host fenced the first in Kafka and shared its files too.
Real broker, real worker processes, rocksdb backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from examples.workers import WorkerProcess, read_events
from integration_tests.warehouse_job import SPEC, WarehouseJob, wait_for, wait_running
from snapline.pipeline.supervisor import EX_CONFIG

pytestmark = pytest.mark.integration

#: The duplicate's wait for the lock (SNAPLINE_LOCAL_LOCK_WAIT; 35 s by default).
LOCK_WAIT_S = 3
#: A refused duplicate: its start-up (imports, pipeline) and the lock's wait.
REFUSAL_BOUND = 60.0


def test_workers_given_one_local_dir_keep_their_own_state_and_a_duplicate_id_is_refused(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, postgres_dsn: str, jobs: list[Any]
) -> None:
    job = WarehouseJob(
        kafka_bootstrap, unique_name, tmp_path, postgres_dsn, partitions=4, backend="rocksdb"
    )
    jobs.append(job)
    shared = tmp_path / "local"
    args = ["--local-dir", str(shared)]
    w0, w1 = job.workers
    w0.start(extra_args=args)
    job.produce(300)
    job.wait_until_caught_up()
    w1.start(extra_args=args)
    wait_running(job)
    job.produce(300)
    job.wait_until_caught_up()

    # A third worker joins and leaves: two more rebalances, after which w0 and w1 each drop
    # the task directories they no longer own, and only those.
    w2 = job.worker("w2")
    job.workers.append(w2)
    w2.start()
    wait_for(
        "w2 running",
        lambda: any(
            e.get("event") == "restored" and e["worker"] == "w2"
            for e in read_events(w0.metrics_path)
        ),
        120,
        job.logs,
    )
    job.produce(300)
    job.wait_until_caught_up()
    assert w2.stop() == 0, job.logs()
    job.produce(300)
    job.wait_until_caught_up()
    assert w0.alive and w1.alive, job.logs()  # before the fix both crashed here
    assert {p.name for p in shared.iterdir()} == {"w0", "w1"}
    for worker in (w0, w1):
        tasks = {p.name for p in (shared / worker.worker_id / job.name).iterdir() if p.is_dir()}
        assert tasks, f"{worker.worker_id} has no local task directory"

    # The same worker id again on this host: refused at start, the running one untouched.
    (tmp_path / "dup").mkdir()
    dup = WorkerProcess(
        SPEC,
        "w0",
        kafka_bootstrap,
        job.checkpoint_dir,
        tmp_path / "dup",
        {**job.env, "SNAPLINE_LOCAL_LOCK_WAIT": str(LOCK_WAIT_S)},
    )
    dup.start(extra_args=args)
    try:
        code = dup.wait_exit(REFUSAL_BOUND)
    finally:
        dup.kill()
    assert code == EX_CONFIG, dup.tail()
    assert "is already running on this host" in dup.tail() and f"pid {w0.proc.pid}" in dup.tail()
    assert f"waited {LOCK_WAIT_S} s" in dup.tail()
    job.produce(300)
    job.wait_until_caught_up()
    assert w0.alive and w1.alive, job.logs()
    assert w0.starts == 1 and w1.starts == 1
    job.stop_all()
    job.verify()
