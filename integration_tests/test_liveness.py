"""A worker whose task thread stops making progress ends itself with every thread's stack in
its log (runtime/liveness.py), so that its supervisor restarts it: exit 75 from the watchdog
thread, or exit 1 from the faulthandler backstop when the stalled thread holds the GIL. A
worker that only waits for input is making progress and lives on. A worker whose consumer is
stuck (left outside its group, or not fetching while records wait) replaces the consumer and
goes on, exactly once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer

from examples.orders import create_topics, read_committed
from examples.workers import WorkerProcess, read_events
from snapline.pipeline.runtime.kafka_calls import EX_TEMPFAIL
from snapline.pipeline.runtime.liveness import CHECK_INTERVAL, REARM_INTERVAL, backstop_after

pytestmark = pytest.mark.integration

TIMEOUT = 5.0
ORDERS = 20


class StallsJob:
    """The topics of integration_tests.pipelines:stalls, its worker (not started) and a
    producer of orders numbered from 0."""

    def __init__(
        self,
        bootstrap: str,
        tmp_path: Path,
        name: str,
        partitions: int,
        env: dict[str, str] | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.prefix = f"{name}-"
        create_topics(bootstrap, {f"{self.prefix}orders": partitions, f"{self.prefix}out": 1})
        self.producer = Producer({"bootstrap.servers": bootstrap})
        self.produced = 0
        self.worker = WorkerProcess(
            "integration_tests.pipelines:stalls",
            "w0",
            bootstrap,
            tmp_path / "chk",
            tmp_path,
            {"SNAPLINE_TEST_PREFIX": self.prefix, **(env or {})},
        )

    def produce(self, count: int, **extra: str) -> None:
        for _ in range(count):
            order = {"order_id": self.produced, **extra}
            self.producer.produce(f"{self.prefix}orders", orjson.dumps(order))
            self.produced += 1
        self.producer.flush(30)

    def outputs(self) -> list[dict[str, Any]]:
        """Every committed output, once there are as many as orders produced."""
        return read_committed(self.bootstrap, f"{self.prefix}out", self.produced, timeout=60)


@pytest.mark.parametrize(
    ("how", "exit_code", "says"),
    [
        ("sleep", EX_TEMPFAIL, "the task thread made no progress"),
        # faulthandler's own header; its exit code is always 1
        ("regex", 1, "Timeout ("),
    ],
)
def test_a_stalled_task_thread_ends_the_worker_with_its_stack(
    kafka_bootstrap: str,
    tmp_path: Path,
    unique_name: str,
    how: str,
    exit_code: int,
    says: str,
) -> None:
    job = StallsJob(kafka_bootstrap, tmp_path, unique_name, 1)
    worker = job.worker
    job.produce(ORDERS)
    worker.start(extra_args=["--liveness-timeout", str(TIMEOUT)])
    try:
        assert len(job.outputs()) == ORDERS
        if how == "sleep":
            # Waiting for input is progress: idle for more than two timeouts, still alive.
            time.sleep(2 * TIMEOUT + CHECK_INTERVAL)
            assert worker.alive, f"an idle worker ended itself\n{worker.tail()}"
        job.produce(1, stall=how)
        stalled = time.monotonic()
        # Bounded: the watchdog fires TIMEOUT after the last beat, the backstop at most
        # REARM_INTERVAL + its delay later; 30 s more for start-up noise on a busy machine.
        bound = TIMEOUT + REARM_INTERVAL + backstop_after(TIMEOUT) + 30
        code = worker.wait_exit(bound)
        took = time.monotonic() - stalled
    finally:
        if worker.alive:
            worker.kill()
    log = worker.log_path.read_text(errors="replace")
    assert code == exit_code, f"exit {code} after {took:.1f}s\n{worker.tail(80)}"
    assert says in log, worker.tail(80)
    # The stack shows where the task thread stood.
    assert "_stall_on_request" in log, worker.tail(80)


@pytest.mark.parametrize(
    ("action", "says"),
    [
        ("leave", "no partition assignment"),
        ("stall", "fetched nothing"),
    ],
)
def test_a_stuck_consumer_is_replaced_and_nothing_is_lost_or_repeated(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, action: str, says: str
) -> None:
    """Right after the first commit the consumer leaves its group and never asks to join
    again ("leave", as librdkafka did after a double broker outage), or stops fetching
    ("stall"). The worker must notice (for the limit, 3 s here, while the broker answers a
    fresh client), replace the consumer in the same process and process every input exactly
    once."""
    metrics = tmp_path / "metrics.jsonl"
    job = StallsJob(
        kafka_bootstrap,
        tmp_path,
        unique_name,
        2,
        {
            "SNAPLINE_FAULT": f"after_kafka_commit:1:{action}",
            "SNAPLINE_TEST_CONSUMER_LIMIT": "3",
            "SNAPLINE_METRICS_FILE": str(metrics),
        },
    )
    worker = job.worker
    job.produce(ORDERS)
    worker.start()
    try:
        pid = worker.proc.pid if worker.proc else None
        assert len(job.outputs()) == ORDERS
        job.produce(ORDERS)  # what a stalled consumer would leave unread
        # Bounded: the consumer broke at the first commit; the limit is 3 s.
        deadline = time.monotonic() + 60
        while not any(e.get("event") == "consumer_replaced" for e in read_events(metrics)):
            assert worker.alive, f"the worker exited\n{worker.tail()}"
            assert time.monotonic() < deadline, f"the consumer was not replaced\n{worker.tail()}"
            time.sleep(0.5)
        outputs = job.outputs()
        assert worker.alive and worker.proc is not None and worker.proc.pid == pid
    finally:
        worker.stop()
    ids = sorted(o["order_id"] for o in outputs)
    assert ids == list(range(2 * ORDERS)), f"lost or duplicated: {ids}"
    replaced = [e for e in read_events(metrics) if e.get("event") == "consumer_replaced"]
    # Any of them: a slow first join on a loaded machine may replace the consumer once
    # before the fault does.
    assert any(says in e["error"] for e in replaced), replaced
