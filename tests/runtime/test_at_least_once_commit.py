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
    def flush(self) -> None:
        pass


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


class _Flushing:
    """A producer whose flush leaves ``remaining`` records undelivered."""

    def __init__(self, remaining: int) -> None:
        self.remaining = remaining

    def flush(self, timeout: float) -> int:
        return self.remaining


def test_outputs_not_delivered_in_time_are_a_broker_outage_and_failed_deliveries_are_not() -> None:
    """At-least-once's flush: records still waiting at its bound say the broker is out of
    reach (waited out, not counted); records the broker refused fail the checkpoint."""
    from snapline.pipeline.runtime.transaction import TransactionalOutput

    output = TransactionalOutput({"bootstrap.servers": "127.0.0.1:1"}, transactional_id=None)
    output.producer = _Flushing(12)  # type: ignore[assignment]
    with pytest.raises(BrokerOutageError, match="is the broker reachable"):
        _worker(output, _Consumer(None))._commit_at_least_once(OFFSETS)  # type: ignore[arg-type]
    output.producer = _Flushing(0)  # type: ignore[assignment]
    output._delivery_errors = ["too large"]
    consumer = _Consumer(None)
    with pytest.raises(CheckpointError) as raised:
        _worker(output, consumer)._commit_at_least_once(OFFSETS)  # type: ignore[arg-type]
    assert not isinstance(raised.value, BrokerOutageError)
    assert consumer.commits == [], "no offsets committed past a failed delivery"
