"""A partition that ``committed()`` answers with an error has no offset to read, not "nothing
committed": its offset is OFFSET_INVALID, the same as a partition never committed. Read as
that, a worker started the task over from the source's starting position (with
``--reset-state`` it deleted the task's committed checkpoints first), and a Spark streaming
driver read its ledger as not committed and committed the batch again. Now such a read is
retried like an unreadable one, and fails when it stays so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import OFFSET_INVALID, KafkaError, KafkaException, TopicPartition

from snapline.pipeline.runtime.kafka_calls import (
    BoundedCall,
    KafkaClientError,
    raise_partition_errors,
)
from snapline.pipeline.runtime.worker import Worker
from snapline.pipeline.spark.stream_commit import _committed_offset


@dataclass
class _Answer:
    """A TopicPartition as ``committed()`` returns it (confluent-kafka's cannot be given an
    error from Python)."""

    topic: str
    partition: int
    offset: int
    metadata: str | None = None
    error: KafkaError | None = None


def _failed(topic: str = "orders", partition: int = 3, code: int = 29) -> _Answer:
    return _Answer(topic, partition, OFFSET_INVALID, None, KafkaError(code))


class _Consumer:
    """Answers each ``committed()`` call with the next of ``answers``."""

    def __init__(self, *answers: list[Any]) -> None:
        self.answers = list(answers)
        self.calls = 0

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[Any]:
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def _worker(consumer: _Consumer, wait: float) -> Worker:
    worker = object.__new__(Worker)  # no broker: only what _committed_offsets reads
    worker.consumer = consumer  # type: ignore[assignment]
    worker._consumer_call = BoundedCall("consumer")
    worker._committed_offsets_wait = wait
    worker._stopping = False
    worker._events = []  # type: ignore[attr-defined]
    worker._event = worker._events.append  # type: ignore[attr-defined,method-assign]
    worker._fence_pending_writers = lambda partitions: None  # type: ignore[method-assign]
    return worker


def test_no_partition_error_raises_nothing() -> None:
    raise_partition_errors([TopicPartition("orders", 0, 5), _Answer("orders", 1, 7)], "x")


def test_a_partition_error_is_raised_with_its_partition_and_code() -> None:
    with pytest.raises(KafkaException) as raised:
        raise_partition_errors([_Answer("orders", 0, 5), _failed()], "committed offsets")
    error = raised.value.args[0]
    assert error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert "committed offsets: orders[3]" in error.str()


def test_the_worker_reads_again_when_a_partition_answered_with_an_error() -> None:
    good = [_Answer("orders", 0, 5, "chk-7"), _Answer("orders", 3, 9, "chk-7")]
    consumer = _Consumer([_Answer("orders", 0, 5, "chk-7"), _failed()], good)
    worker = _worker(consumer, wait=30.0)
    got = worker._committed_offsets([TopicPartition("orders", 0), TopicPartition("orders", 3)])
    assert got == good
    assert consumer.calls == 2
    assert worker._events[0]["event"] == "offsets_pending"  # type: ignore[attr-defined]


def test_the_worker_fails_rather_than_read_an_error_as_no_offsets() -> None:
    consumer = _Consumer([_Answer("orders", 0, 5, "chk-7"), _failed()])
    with pytest.raises(KafkaClientError, match=r"orders\[3\].*authorization"):
        _worker(consumer, wait=0.0)._committed_offsets([TopicPartition("orders", 0)])


def test_the_spark_ledger_read_does_not_take_an_error_for_not_committed() -> None:
    # Not a coordinator error: raised at once, never read as offset -1001 ("not committed").
    with pytest.raises(KafkaException, match="ledger"):
        _committed_offset(_Consumer([_failed("ledger", 0)]), TopicPartition("ledger", 0))
    # A coordinator that is loading is waited for, as a whole-request error is.
    consumer = _Consumer([_failed("ledger", 0, code=14)], [_Answer("ledger", 0, 4, "tok")])
    assert _committed_offset(consumer, TopicPartition("ledger", 0), timeout=30) == (4, "tok")
    assert consumer.calls == 2
