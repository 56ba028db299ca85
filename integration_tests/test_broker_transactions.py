"""The session's broker is a real, transactional Kafka: the guarantees Snapline's commit
point relies on (read_committed visibility, abort, fencing, offsets with metadata) hold."""

from __future__ import annotations

import os
import time

import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from integration_tests.conftest import create_topic

TIMEOUT = 30.0


def transactional_producer(bootstrap: str, transactional_id: str) -> Producer:
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": transactional_id,
            "transaction.timeout.ms": 60000,
        }
    )
    producer.init_transactions(TIMEOUT)
    return producer


def log_end(bootstrap: str, topic: str) -> int:
    """The high watermark of partition 0: every record and transaction marker written so far."""
    probe = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{topic}-probe",
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        return probe.get_watermark_offsets(TopicPartition(topic, 0), TIMEOUT, cached=False)[1]
    finally:
        probe.close()


def read_all(bootstrap: str, topic: str, isolation: str) -> list[str]:
    """Every value of partition 0 that a reader with ``isolation`` sees, up to the log end.

    Transaction markers are written after commit_transaction returns, so the end is the high
    watermark (not the last stable offset, which may still lag); a read_committed reader
    reaches it only once every transaction below it is decided.
    """
    end = log_end(bootstrap, topic)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{topic}-reader-{isolation}",
            "enable.auto.commit": False,
            "isolation.level": isolation,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        values: list[str] = []
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None:
                if message.error():
                    raise KafkaException(message.error())
                values.append(message.value().decode())
            position = consumer.position([TopicPartition(topic, 0)])[0].offset
            if position >= end:
                return values
        raise AssertionError(f"reader did not reach offset {end} of {topic}; saw {values}")
    finally:
        consumer.close()


def test_committed_transaction_is_visible_to_read_committed(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str
) -> None:
    topic = create_topic(admin, unique_name)
    producer = transactional_producer(kafka_bootstrap, unique_name)
    producer.begin_transaction()
    for i in range(5):
        producer.produce(topic, value=f"c{i}".encode())
    producer.commit_transaction(TIMEOUT)

    assert read_all(kafka_bootstrap, topic, "read_committed") == [f"c{i}" for i in range(5)]


def test_aborted_transaction_is_never_visible(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str
) -> None:
    topic = create_topic(admin, unique_name)
    producer = transactional_producer(kafka_bootstrap, unique_name)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, value=f"aborted{i}".encode())
    producer.flush(TIMEOUT)  # the aborted records really reach the log
    producer.abort_transaction(TIMEOUT)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, value=f"committed{i}".encode())
    producer.commit_transaction(TIMEOUT)

    committed = [f"committed{i}" for i in range(3)]
    assert read_all(kafka_bootstrap, topic, "read_committed") == committed
    # The control: the aborted records are in the log, only read_committed hides them.
    uncommitted = read_all(kafka_bootstrap, topic, "read_uncommitted")
    assert uncommitted == [f"aborted{i}" for i in range(3)] + committed


def test_new_producer_with_same_transactional_id_fences_the_old_one(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str
) -> None:
    topic = create_topic(admin, unique_name)
    zombie = transactional_producer(kafka_bootstrap, unique_name)
    zombie.begin_transaction()
    zombie.produce(topic, value=b"zombie-open")
    zombie.flush(TIMEOUT)

    successor = transactional_producer(kafka_bootstrap, unique_name)  # fences the zombie

    with pytest.raises(KafkaException) as raised:
        zombie.produce(topic, value=b"zombie-late")
        zombie.commit_transaction(TIMEOUT)
    error: KafkaError = raised.value.args[0]
    del raised  # its traceback would keep the zombie alive past the broker's shutdown
    zombie.purge()
    assert error.fatal() or error.code() in (
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
    ), error

    successor.begin_transaction()
    successor.produce(topic, value=b"successor")
    successor.commit_transaction(TIMEOUT)
    # The zombie's open transaction was aborted when the successor initialized.
    assert read_all(kafka_bootstrap, topic, "read_committed") == ["successor"]


def test_offsets_sent_to_transaction_carry_metadata_to_a_new_consumer(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str
) -> None:
    source = create_topic(admin, f"{unique_name}-in")
    sink = create_topic(admin, f"{unique_name}-out")
    group = f"{unique_name}-group"
    feeder = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(5):
        feeder.produce(source, value=f"in{i}".encode())
    feeder.flush(TIMEOUT)

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    consumer.assign([TopicPartition(source, 0, OFFSET_BEGINNING)])
    consumed = []
    deadline = time.monotonic() + TIMEOUT
    while len(consumed) < 3 and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is not None and not message.error():
            consumed.append(message)
    assert len(consumed) == 3

    producer = transactional_producer(kafka_bootstrap, unique_name)
    producer.begin_transaction()
    for message in consumed:
        producer.produce(sink, value=message.value())
    next_offset = consumed[-1].offset() + 1
    producer.send_offsets_to_transaction(
        [TopicPartition(source, 0, next_offset, metadata="checkpoint=7")],
        consumer.consumer_group_metadata(),
        TIMEOUT,
    )
    producer.commit_transaction(TIMEOUT)
    consumer.close()

    fresh = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
    try:
        [committed] = fresh.committed([TopicPartition(source, 0)], timeout=TIMEOUT)
    finally:
        fresh.close()
    assert committed.offset == next_offset == 3
    assert committed.metadata == "checkpoint=7"
    assert read_all(kafka_bootstrap, sink, "read_committed") == ["in0", "in1", "in2"]


@pytest.mark.parametrize("exactly_once", [True, False], ids=["exactly-once", "at-least-once"])
def test_a_record_the_broker_refuses_fails_the_commit_without_delivery_reports(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str, exactly_once: bool
) -> None:
    """A worker's producer reports failed deliveries only (``delivery.report.only.error``: a
    delivered record costs no event to serve). A record the broker refuses (larger than the
    topic's ``max.message.bytes``, as when the limit was lowered after the worker read it)
    must still fail the commit point, and nothing of its epoch becomes visible to
    read_committed."""
    from snapline.pipeline.errors import CheckpointError
    from snapline.pipeline.runtime.transaction import (
        TransactionalOutput,
        TransactionFailedError,
    )

    topic = create_topic(admin, unique_name, config={"max.message.bytes": "2000"})
    output = TransactionalOutput(
        {"bootstrap.servers": kafka_bootstrap},
        transactional_id=f"{unique_name}-tx" if exactly_once else None,
    )
    assert output._conf["delivery.report.only.error"] is True
    if exactly_once:
        output.init()
        output.begin(1)
    output.produce(1, topic, b"fits", b"k")
    # Under the producer's limit, over the topic's (random: the batch is compressed).
    output.produce(1, topic, os.urandom(10_000), b"k")
    if exactly_once:
        # Once the refusal arrived, the transaction takes no more records: the epoch fails
        # (TransactionFailedError, a CheckpointError) instead of a client error.
        output.producer.flush(20)
        with pytest.raises(TransactionFailedError, match="the open transaction failed"):
            output.produce(1, topic, b"after", b"k")
    with pytest.raises((CheckpointError, KafkaException)):
        if exactly_once:
            output.commit([], None, timeout=20)
        else:
            output.flush(20)
    if exactly_once:
        output.abort()
        assert read_all(kafka_bootstrap, topic, "read_committed") == []


def test_a_transaction_timeout_above_the_brokers_maximum_is_a_configuration_error(
    kafka_bootstrap: str, unique_name: str
) -> None:
    """librdkafka makes the broker's INVALID_TRANSACTION_TIMEOUT fatal: it was taken for a
    fenced producer, and every restart failed the same way. It is the job's setting: a
    ConfigurationError (exit 78) naming the fix."""
    from snapline.pipeline.errors import ConfigurationError
    from snapline.pipeline.runtime.transaction import TransactionalOutput

    output = TransactionalOutput(
        {"bootstrap.servers": kafka_bootstrap, "transaction.timeout.ms": 1_000_000},
        transactional_id=f"{unique_name}-tx",
    )
    with pytest.raises(ConfigurationError, match="above their transaction.max.timeout.ms"):
        output.init(timeout=30)
