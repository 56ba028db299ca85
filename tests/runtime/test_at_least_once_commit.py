"""The at-least-once commit point fails like the exactly-once one: an unreachable broker is an
outage the worker waits out, a refused commit (the member expired, the group rebalanced) a
failed checkpoint the epoch is read again for. Both escaped as client errors (exit 75)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from snapline.pipeline.errors import CheckpointError
from snapline.pipeline.runtime.kafka_calls import BoundedCall, BrokerOutageError
from snapline.pipeline.runtime.worker import Worker


class _Output:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    def flush(self) -> None:
        if self.error is not None:
            raise self.error


class _Consumer:
    def __init__(self, code: int | None) -> None:
        self.code = code
        self.commits: list[Any] = []

    def commit(self, offsets: Any, asynchronous: bool) -> None:
        if self.code is not None:
            raise KafkaException(KafkaError(self.code, "refused"))
        self.commits.append(offsets)


def _worker(output: _Output, consumer: _Consumer) -> Worker:
    worker = object.__new__(Worker)  # no broker: only what _commit_at_least_once reads
    worker.output = output  # type: ignore[assignment]
    worker.consumer = consumer  # type: ignore[assignment]
    worker._consumer_call = BoundedCall("consumer")
    return worker


OFFSETS = [TopicPartition("in", 0, 42)]


def test_the_offsets_are_committed_after_the_outputs() -> None:
    consumer = _Consumer(None)
    _worker(_Output(), consumer)._commit_at_least_once(OFFSETS)
    assert consumer.commits == [OFFSETS]


@pytest.mark.parametrize(
    "code", [KafkaError._WAIT_COORD, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError._TRANSPORT]
)
def test_an_unreachable_coordinator_is_a_broker_outage(code: int) -> None:
    with pytest.raises(BrokerOutageError):
        _worker(_Output(), _Consumer(code))._commit_at_least_once(OFFSETS)


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.REBALANCE_IN_PROGRESS,
    ],
)
def test_a_refused_commit_is_a_failed_checkpoint(code: int) -> None:
    with pytest.raises(CheckpointError) as raised:
        _worker(_Output(), _Consumer(code))._commit_at_least_once(OFFSETS)
    assert not isinstance(raised.value, BrokerOutageError)


def test_outputs_not_delivered_in_time_are_a_broker_outage_and_failed_deliveries_are_not() -> None:
    late = CheckpointError("12 records not delivered within 60.0s")
    with pytest.raises(BrokerOutageError, match="is the broker reachable"):
        _worker(_Output(late), _Consumer(None))._commit_at_least_once(OFFSETS)
    failed = CheckpointError("records failed delivery: ['too large']")
    with pytest.raises(CheckpointError) as raised:
        _worker(_Output(failed), _Consumer(None))._commit_at_least_once(OFFSETS)
    assert not isinstance(raised.value, BrokerOutageError)
