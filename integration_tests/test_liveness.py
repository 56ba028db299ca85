"""A worker whose task thread stops making progress ends itself with every thread's stack in
its log (runtime/liveness.py), so that its supervisor restarts it: exit 75 from the watchdog
thread, or exit 1 from the faulthandler backstop when the stalled thread holds the GIL. A
worker that only waits for input is making progress and lives on."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer

from examples.orders import create_topics, read_committed
from examples.workers import WorkerProcess
from snapline.pipeline.runtime.kafka_calls import EX_TEMPFAIL
from snapline.pipeline.runtime.liveness import CHECK_INTERVAL, REARM_INTERVAL, backstop_after

pytestmark = pytest.mark.integration

TIMEOUT = 5.0
ORDERS = 20


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
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}orders": 1, f"{prefix}out": 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(ORDERS):
        producer.produce(f"{prefix}orders", orjson.dumps({"order_id": i}))
    producer.flush(30)
    worker = WorkerProcess(
        "integration_tests.pipelines:stalls",
        "w0",
        kafka_bootstrap,
        tmp_path / "chk",
        tmp_path,
        {"SNAPLINE_TEST_PREFIX": prefix},
    )
    worker.start(extra_args=["--liveness-timeout", str(TIMEOUT)])
    try:
        assert len(read_committed(kafka_bootstrap, f"{prefix}out", ORDERS, timeout=60)) == ORDERS
        if how == "sleep":
            # Waiting for input is progress: idle for more than two timeouts, still alive.
            time.sleep(2 * TIMEOUT + CHECK_INTERVAL)
            assert worker.alive, f"an idle worker ended itself\n{worker.tail()}"
        producer.produce(f"{prefix}orders", orjson.dumps({"order_id": ORDERS, "stall": how}))
        producer.flush(30)
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
