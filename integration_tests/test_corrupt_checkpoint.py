"""A corrupt committed checkpoint, seen by a real worker: detected by its checksum; by default
the worker refuses to continue on wrong state; with on_corrupt_checkpoint='rewind' it restores
the previous checkpoint and loses nothing (the span in between is processed again)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from examples.orders import create_topics, produce_orders, read_committed
from examples.workers import WorkerProcess, read_events
from snapline.pipeline.checkpoint.metadata import CheckpointRef, TaskCheckpoint

pytestmark = pytest.mark.integration


def _committed_ref(bootstrap: str, group: str, topic: str) -> CheckpointRef:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        (tp,) = consumer.committed([TopicPartition(topic, 0)], 10)
    finally:
        consumer.close()
    ref = CheckpointRef.parse_offset_metadata(tp.metadata)
    assert ref is not None
    return ref


def test_corrupt_committed_checkpoint_fails_or_rewinds(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    topic = f"{prefix}orders"
    create_topics(kafka_bootstrap, {topic: 1, f"{prefix}customer-totals": 1})
    env = {
        "SNAPLINE_EXAMPLE_PREFIX": prefix,
        "SNAPLINE_EXAMPLE_JOB": unique_name,
        "SNAPLINE_EXAMPLE_INTERVAL": "0.3",
    }
    worker = WorkerProcess(
        "examples.running_total:pipeline", "w0", kafka_bootstrap, tmp_path / "chk", tmp_path, env
    )
    worker.start()
    produced = 0

    def checkpoints() -> int:
        return sum(e.get("event") == "checkpoint" for e in read_events(worker.metrics_path))

    # Input until two checkpoints committed, so an earlier one is retained to rewind to.
    for _ in range(40):
        produce_orders(kafka_bootstrap, topic, 500, 50, start_id=produced)
        produced += 500
        time.sleep(1.0)
        if checkpoints() >= 2:
            break
    assert worker.stop() == 0, worker.tail()
    assert checkpoints() >= 2, "the test needs an earlier checkpoint to rewind to"
    ref = _committed_ref(kafka_bootstrap, unique_name, topic)
    storage_root = tmp_path / "chk"
    from snapline.pipeline.checkpoint.storage import CheckpointStorage

    meta = TaskCheckpoint.read(CheckpointStorage(str(storage_root)), unique_name, "p0", ref)
    assert meta.state is not None
    state_file = storage_root / meta.state.files[0].path
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state_file.write_bytes(bytes(data))

    produce_orders(kafka_bootstrap, topic, 1000, 50, start_id=produced)
    produced += 1000
    worker.start()
    assert worker.proc is not None
    assert worker.proc.wait(60) != 0
    log = worker.log_path.read_text()
    assert "checksum" in log and "on_corrupt_checkpoint='rewind'" in log

    worker.env["SNAPLINE_EXAMPLE_ON_CORRUPT"] = "rewind"
    worker.start()
    # The rewind re-emits the span between the two checkpoints, so the output count reaches
    # `produced` before every order has come through: wait for the orders, not the count.
    seen: set[int] = set()
    deadline = time.monotonic() + 90
    while seen != set(range(produced)) and time.monotonic() < deadline:
        outputs = read_committed(
            kafka_bootstrap, f"{prefix}customer-totals", produced, timeout=30, settle=2
        )
        seen = {o["order_id"] for o in outputs}
    worker.stop()
    assert seen == set(range(produced)), "the rewind lost orders"
    assert "REWINDING" in worker.log_path.read_text()
    assert any(e.get("event") == "checkpoint" for e in read_events(worker.metrics_path))
