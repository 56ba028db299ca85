"""Which topics Snapline creates (issue 9, item 7), on a real broker: the README's pipeline
shape with an output topic that does not exist yet runs and creates it like its source; a
missing source topic stops the worker at start, naming the fix, before anything is created."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.workers import WorkerProcess, child_pythonpath
from snapline.pipeline.supervisor import EX_CONFIG

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
ORDERS = 2_000


def _partitions(admin: AdminClient, topic: str) -> int | None:
    meta = admin.list_topics(timeout=10).topics.get(topic)
    return None if meta is None or meta.error is not None else len(meta.partitions)


def test_missing_output_topic_is_created_and_receives_the_output(
    kafka_bootstrap: str, admin: AdminClient, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    orders, totals = f"{prefix}orders", f"{prefix}customer-totals"
    create_topics(kafka_bootstrap, {orders: 3})  # only the source, as a user would
    assert _partitions(admin, totals) is None
    expected = produce_orders(kafka_bootstrap, orders, ORDERS, 50)
    # examples/running_total.py is the README's snippet: KafkaSource -> key_by -> KafkaSink
    worker = WorkerProcess(
        "examples.running_total:pipeline",
        "w0",
        kafka_bootstrap,
        tmp_path / "chk",
        tmp_path,
        {"SNAPLINE_EXAMPLE_PREFIX": prefix, "SNAPLINE_EXAMPLE_JOB": unique_name},
    )
    worker.start()
    try:
        deadline = time.monotonic() + 60  # worker start + topic creation
        while _partitions(admin, totals) is None:
            assert worker.alive, worker.tail()
            assert time.monotonic() < deadline, "output topic not created:\n" + worker.tail()
            time.sleep(0.2)
        outputs = read_committed(kafka_bootstrap, totals, ORDERS, timeout=90, settle=1)
    finally:
        worker.stop()
    assert _partitions(admin, totals) == 3  # like the source topic
    assert _partitions(admin, f"{unique_name}.dead-letter") == 1  # Snapline's own topic
    result = verify_totals(outputs, expected, range(ORDERS))
    assert result.ok, result
    assert f"created topic {totals} (3 partitions)" in worker.tail(400)


def test_missing_source_topic_fails_at_start_naming_the_fix(
    kafka_bootstrap: str, admin: AdminClient, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "snapline.pipeline.cli",
            "run",
            "integration_tests.pipelines:missing_topic",
            "--bootstrap-servers",
            kafka_bootstrap,
            "--checkpoint-dir",
            str(tmp_path / "chk"),
            "--worker-id",
            "w0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "SNAPLINE_TEST_PREFIX": prefix, "PYTHONPATH": child_pythonpath()},
    )
    assert result.returncode == EX_CONFIG, result.stderr[-3000:]
    assert time.monotonic() - started < 60
    error = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1, result.stderr[-3000:]
    assert f"['{prefix}no-such-topic'] do not exist on {kafka_bootstrap}" in error[0]
    assert "create_partitions=N to the KafkaSource" in error[0]
    # nothing was created on the way to that error: not the output, not the dead-letter topic
    assert _partitions(admin, f"{prefix}out") is None
    assert _partitions(admin, f"{prefix}job.dead-letter") is None


def test_listed_groups_tells_groups_with_members_from_empty_ones_without_describing(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str
) -> None:
    """listed_groups (ListGroups, no coordinator lookup: librdkafka #4605) is what the worker's
    start-up checks ask before any group request: a savepoint restore's lock group with its
    member, then without; an unknown group is absent."""
    from confluent_kafka import Consumer

    from snapline.pipeline.runtime.kafka_calls import listed_groups

    topic = f"{unique_name}-lock"
    create_topics(kafka_bootstrap, {topic: 1})
    group = f"{unique_name}/restore"
    consumer = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": group, "session.timeout.ms": 6000}
    )
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30  # a join takes ~3 s (group.initial.rebalance.delay)
        while not consumer.assignment():
            assert time.monotonic() < deadline, "the consumer never joined its group"
            consumer.poll(0.2)
        assert listed_groups(admin, 10, [group]).get(group) is True
    finally:
        consumer.close()  # leaves the group: it is empty now
    assert listed_groups(admin, 10, [group]).get(group) is False
    assert f"{unique_name}/no-such-group" not in listed_groups(admin, 10, [])
