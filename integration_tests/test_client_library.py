"""What the worker needs of the installed confluent-kafka, against a real broker."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from integration_tests.conftest import create_topic
from snapline.pipeline.runtime.kafka_calls import BoundedCall, installed_client_version

pytestmark = [pytest.mark.integration]


def test_a_bounded_consumer_call_returns_inside_the_rebalance_callback(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str
) -> None:
    """A worker restores a task inside ``on_assign`` (inside ``consume``) and asks the
    consumer for committed offsets there through its bounded calls. Those run on the
    callback's thread (``BoundedCall``'s ``inline``): from confluent-kafka 2.16 a Consumer
    admits one thread at a time, and a helper thread waited for ``consume`` forever. The
    newest release the pin admits is covered by a worker test
    (test_exactly_once_kill.py, ``..._newest_client_...``); this is the installed one."""
    topic = create_topic(admin, f"{unique_name}-in", partitions=2)
    consumer = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": unique_name, "enable.auto.commit": False}
    )
    inside: list[int] = []  # the thread in the callback
    call = BoundedCall("consumer", inline=lambda: threading.get_ident() in inside)
    committed: list[list[TopicPartition]] = []
    ran_on: list[tuple[int, int]] = []  # (the callback's thread, the call's thread)

    def committed_here(c: Consumer, partitions: list[TopicPartition]) -> list[TopicPartition]:
        ran_on.append((inside[0], threading.get_ident()))
        return c.committed(partitions, timeout=10)

    def on_assign(c: Consumer, partitions: list[TopicPartition]) -> None:
        inside.append(threading.get_ident())
        try:
            committed.append(call("committed", 20, committed_here, c, partitions))
        finally:
            inside.clear()

    try:
        consumer.subscribe([topic], on_assign=on_assign)
        deadline = time.monotonic() + 60  # a group join on a fresh broker takes seconds
        while not committed and time.monotonic() < deadline:
            consumer.consume(10, 0.5)
        assert committed, f"no assignment within 60 s on {installed_client_version()}"
        assert len(committed[0]) == 2
        # On the callback's thread: before 2.16 a helper thread's call returns too, so this
        # holds the property on every release; from 2.16 a helper waits for consume().
        assert ran_on[0][0] == ran_on[0][1]
    finally:
        consumer.close()
