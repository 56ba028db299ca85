"""What the worker needs of the installed confluent-kafka, against a real broker."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from integration_tests.conftest import create_topic
from snapline.pipeline.runtime.kafka_calls import installed_client_version

pytestmark = [pytest.mark.integration]


def test_a_consumer_call_from_a_helper_thread_returns_inside_the_rebalance_callback(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str
) -> None:
    """A worker restores a task inside ``on_assign`` (inside ``consume``) and runs the
    callback's client calls on a helper thread with a bound (runtime/kafka_calls.py). From
    confluent-kafka 2.16 a Consumer lets one thread at a time into its calls, so that
    ``committed`` waited for ``consume`` and every worker hung at its first assignment; the
    pin in pyproject.toml and ``check_client_library`` keep it out. This is the property
    they protect, on the version installed."""
    topic = create_topic(admin, f"{unique_name}-in", partitions=2)
    consumer = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": unique_name, "enable.auto.commit": False}
    )
    committed: list[list[TopicPartition]] = []  # the helper's answer
    joined: list[bool] = []  # whether the callback saw the helper return within its bound

    def on_assign(c: Consumer, partitions: list[TopicPartition]) -> None:
        helper = threading.Thread(
            target=lambda: committed.append(c.committed(partitions, timeout=10)), daemon=True
        )
        helper.start()
        helper.join(20)  # the worker's bound is of the same order
        joined.append(not helper.is_alive())

    try:
        consumer.subscribe([topic], on_assign=on_assign)
        deadline = time.monotonic() + 60  # a group join on a fresh broker takes seconds
        while not joined and time.monotonic() < deadline:
            consumer.consume(10, 0.5)
        assert joined, "no assignment within 60 s"
        assert joined[0], f"committed() hung in on_assign on {installed_client_version()}"
        assert len(committed[0]) == 2
    finally:
        consumer.close()
