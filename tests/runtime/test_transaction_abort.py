"""What an abort does when librdkafka refuses it (no broker: the producer's calls are
stubbed; a Producer object is created but never connects)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from snapline.pipeline.runtime import transaction
from snapline.pipeline.runtime.transaction import RECORD_OVERHEAD, FencedError, TransactionalOutput


class StuckInCommit:
    """A producer whose commit_transaction timed out and still runs inside librdkafka."""

    def abort_transaction(self, timeout: float) -> None:
        raise KafkaException(
            KafkaError(
                KafkaError._CONFLICT,
                "Conflicting commit_transaction API call is already in progress",
            )
        )


class StuckInCommitRetriable:
    """StuckInCommit as librdkafka raises it: the _CONFLICT error is marked retriable."""

    def __init__(self) -> None:
        self.calls = 0

    def abort_transaction(self, timeout: float) -> None:
        self.calls += 1
        raise KafkaException(
            KafkaError(
                KafkaError._CONFLICT,
                "Conflicting commit_transaction API call is already in progress",
                retriable=True,
            )
        )


class NothingToAbort:
    def abort_transaction(self, timeout: float) -> None:
        raise KafkaException(KafkaError(KafkaError._STATE, "No transaction in progress"))


def output_with(
    producer: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[TransactionalOutput, list[str]]:
    output = TransactionalOutput({"bootstrap.servers": "127.0.0.1:1"}, transactional_id="t")
    output.producer = producer
    output.abort_timeout = 0.5
    replaced: list[str] = []
    monkeypatch.setattr(output, "_replace_producer", lambda: replaced.append(str(output._fatal)))
    output.open_epoch = 7
    return output, replaced


def test_an_abort_refused_for_a_commit_in_progress_replaces_the_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    output, replaced = output_with(StuckInCommit(), monkeypatch)
    output.abort()
    assert (
        len(replaced) == 1 and "commit_transaction API call is already in progress" in replaced[0]
    )
    assert output.open_epoch is None


def test_a_retriable_conflict_replaces_the_producer_without_retrying_the_abort(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka builds _CONFLICT as retriable: the abort was retried for its whole bound
    (10-15 s of stall per commit whose outcome was unknown) before the producer was
    replaced, though no retry can succeed while the commit runs."""
    producer = StuckInCommitRetriable()
    output, replaced = output_with(producer, monkeypatch)
    output.abort_timeout = 10.0
    output.abort()
    assert producer.calls == 1
    assert len(replaced) == 1 and "already in progress" in replaced[0]
    assert output.open_epoch is None


def test_an_abort_with_nothing_to_abort_keeps_the_producer(monkeypatch: pytest.MonkeyPatch) -> None:
    output, replaced = output_with(NothingToAbort(), monkeypatch)
    output.abort()
    assert replaced == [] and output.open_epoch is None


class Fenced:
    """A transactional producer fenced while the epoch ran: every produce is refused."""

    def produce(self, *args: Any, **kwargs: Any) -> None:
        raise KafkaException(KafkaError(KafkaError._FATAL, "Unable to produce message"))

    def abort_transaction(self, timeout: float) -> None:
        raise KafkaException(KafkaError(KafkaError._FENCED, "fenced by a newer instance"))


class TooLarge:
    def produce(self, *args: Any, **kwargs: Any) -> None:
        raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "too large"))

    def abort_transaction(self, timeout: float) -> None:
        pass


def test_a_produce_refused_by_a_fenced_producer_fails_the_epoch_and_the_abort_replaces_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not a client error that ends the worker (exit 75): FencedError, which the worker
    handles like a fenced commit (abort, replace the producer, restore)."""
    output, replaced = output_with(Fenced(), monkeypatch)
    with pytest.raises(FencedError, match="produce failed fatally"):
        output.produce(7, "out", b"v", b"k")
    output.abort()
    # the first replacement is for the produce (the stub keeps the old producer, whose
    # abort_transaction is refused in turn)
    assert replaced and "Unable to produce message" in replaced[0], replaced


def test_a_produce_refused_for_another_reason_raises_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    output, replaced = output_with(TooLarge(), monkeypatch)
    with pytest.raises(KafkaException) as info:
        output.produce(7, "out", b"v", b"k")
    assert not isinstance(info.value, FencedError) and output._fatal is None
    output.abort()
    assert replaced == []


def test_a_held_record_too_large_for_the_producer_is_refused_when_it_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Records of a later epoch wait in memory; one librdkafka would refuse is refused at
    once (as librdkafka does for the open epoch), so the sink dead-letters it instead of the
    next begin failing on it."""
    output, _ = output_with(TooLarge(), monkeypatch)
    output.max_message_bytes = 100 + RECORD_OVERHEAD + len("h") + 1 + 10
    output.produce(8, "out", b"v" * 90, b"k" * 10, [("h", b"x")])  # exactly the limit: held
    with pytest.raises(KafkaException) as info:
        output.produce(8, "out", b"v" * 91, b"k" * 10, [("h", b"x")])
    assert info.value.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE
    assert output.held == 1


class AbortNeverEnds:
    """An abort that times out on every attempt although the broker answers ("retry call to
    resume" forever, seen in a bounce-test run)."""

    def abort_transaction(self, timeout: float) -> None:
        raise KafkaException(
            KafkaError(
                KafkaError._TIMED_OUT,
                "Timed out waiting for operation to finish, retry call to resume",
                retriable=True,
            )
        )

    def begin_transaction(self) -> None:
        pass


def test_a_pending_abort_still_stuck_at_begin_replaces_the_producer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """begin runs after the worker rejoined its group: an abort still timing out then is
    stuck, and a new producer's init_transactions ends the transaction instead of the worker
    retrying it for minutes."""
    monkeypatch.setattr(transaction, "PENDING_ABORT_BOUND", 1.0)
    output, replaced = output_with(AbortNeverEnds(), monkeypatch)
    output.abort()  # times out: left pending
    assert replaced == [] and output._abort_pending
    output.begin(8)
    assert len(replaced) == 1 and "abort_transaction still not done" in replaced[0], replaced
    assert output.open_epoch == 8


class Recording:
    """Takes every record; refuses the first produce call with a full queue (BufferError)."""

    def __init__(self) -> None:
        self.records: list[tuple[Any, ...]] = []
        self.full_once = True

    def produce(self, topic: str, value: Any = None, key: Any = None, **kwargs: Any) -> None:
        if self.full_once:
            self.full_once = False
            raise BufferError("queue full")
        self.records.append((topic, value, key, kwargs.get("headers"), kwargs.get("partition")))

    def poll(self, timeout: float = 0) -> int:
        return 0


def test_records_held_for_the_next_epoch_are_sent_in_order_when_its_transaction_begins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Records of epoch 8 produced while epoch 7's transaction is open wait; ``begin(8)``
    sends them in produce order, plain ones straight to the producer and those with headers
    or a partition through the general path, a full queue retried; epoch 9's keep waiting."""
    producer = Recording()
    output, _ = output_with(producer, monkeypatch)
    output.produce(8, "out", b"a", b"k")
    output.produce(8, "dlq", b"b", None, [("snapline.error", b"x")])
    output.produce(9, "out", b"later", b"k")
    output.produce(8, "rep", b"c", b"k", partition=3, timestamp=5)
    output.produce(8, "out", b"d", b"k")
    assert output.held == 5 and producer.records == []
    output.open_epoch = None
    output._open(8)
    assert producer.records == [
        ("out", b"a", b"k", None, None),
        ("dlq", b"b", None, [("snapline.error", b"x")], None),
        ("rep", b"c", b"k", None, 3),
        ("out", b"d", b"k", None, None),
    ]
    assert output.held == 1 and output.produced == 4


def test_at_least_once_reports_a_failed_delivery_at_flush_without_a_callback_per_record() -> None:
    """At-least-once produces without a per-record callback (librdkafka reports only failed
    deliveries, to the producer's on_delivery): a record that never reaches a broker still
    fails the flush that precedes the offset commit. A real librdkafka producer, no broker."""
    output = TransactionalOutput(
        {"bootstrap.servers": "127.0.0.1:1", "message.timeout.ms": 300}, transactional_id=None
    )
    assert output.direct_producer(3) is output.producer
    output.produce(3, "out", b"v", b"k")
    output.direct_producer(3).produce("out", b"w", b"k")  # type: ignore[union-attr]
    with pytest.raises(transaction.CheckpointError, match="records failed delivery"):
        output.flush(10)


def test_new_record_size_limits_replace_the_producer_at_the_abort_without_calling_it_fatal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    output = TransactionalOutput({"bootstrap.servers": "127.0.0.1:1"}, transactional_id="t")
    monkeypatch.setattr(output, "init", lambda: None)  # init_transactions: no broker here
    limits = {"message.max.bytes": 60_000, "batch.size": 50_000}
    assert output.resize(limits) is True
    assert output.resize(limits) is False  # the same limits again: nothing to do
    old = output.producer
    with caplog.at_level("INFO", logger=transaction.__name__):
        output.abort()  # no open transaction: the replacement alone
    assert output.producer is not old and output.replaced == 1
    assert output.max_message_bytes == 60_000 and output._conf["batch.size"] == 50_000
    assert output._fatal is None and output._resized is None
    assert "new record size limits" in caplog.text and "cannot go on" not in caplog.text


@pytest.mark.parametrize(
    ("config", "interval", "timeout", "expected"),
    [
        ({}, 1.0, 60.0, 71_000),  # the defaults: a second, a checkpoint of up to 60 s, a commit
        ({}, 1.0, 30.0, 60_000),  # never below the 60 s default
        ({}, 60.0, 60.0, 130_000),  # a minute's transaction and its checkpoint
        ({}, 290.0, 600.0, 900_000),  # the brokers' default maximum
        ({"transaction.timeout.ms": 5000}, 1.0, 60.0, 5000),  # a setting is kept (logged)
        ({"transaction.timeout.ms": "200000"}, 100.0, 60.0, 200_000),
    ],
)
def test_the_transaction_timeout_outlasts_a_checkpoint_interval_and_its_checkpoint(
    config: dict[str, Any], interval: float, timeout: float, expected: int
) -> None:
    """A transaction is open from one commit to the next. Left at 60 s, a job checkpointing
    every minute or more never committed: the broker aborted each transaction first."""
    assert transaction.transaction_timeout(config, interval, timeout) == expected


@pytest.mark.parametrize(
    ("config", "interval", "message"),
    [
        ({"transaction.timeout.ms": 60000}, 120.0, "Set it to 190000 or more"),
        ({"transaction.timeout.ms": "soon"}, 1.0, "is not a number of ms"),
        ({}, 900.0, "together at most 890 s"),
    ],
)
def test_a_transaction_timeout_a_checkpoint_cannot_fit_fails_at_start_with_the_fix(
    config: dict[str, Any], interval: float, message: str
) -> None:
    from snapline.pipeline.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=message):
        transaction.transaction_timeout(config, interval, 60.0)


def test_a_restore_waits_for_the_transaction_timeout_the_workers_use() -> None:
    """A restore waits out a worker's open transaction for the job's transaction timeout: the
    one its workers use (raised for a long checkpoint interval), not the 60 s default."""
    from snapline import Pipeline
    from snapline.pipeline.savepoint.restore import _transaction_timeout

    assert _transaction_timeout(Pipeline("j")) == 71.0
    assert _transaction_timeout(Pipeline("j", checkpoint_interval=120)) == 190.0
    given = Pipeline("j", kafka_config={"transaction.timeout.ms": 2000})
    assert _transaction_timeout(given) == 2.0
