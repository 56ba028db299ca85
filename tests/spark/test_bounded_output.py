"""A bounded Spark task's output: Kafka records are held (spilled to a local file past a
bound) until ``send`` opens the transaction, then produced in the task's order; repartition
records go to the shuffle. Pure logic: a recording stand-in for the transactional output."""

from __future__ import annotations

from typing import Any

import pytest

from snapline.pipeline.spark import bounded
from snapline.pipeline.spark.bounded import _Output


class _Transaction:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def begin(self, epoch: int) -> None:
        self.calls.append(("begin", epoch))

    def produce(self, epoch: int, topic: str, value: Any, key: Any, *rest: Any) -> None:
        self.calls.append(("produce", epoch, topic, value, key, *rest))


def test_output_is_held_spilled_and_produced_in_order_once_the_transaction_opens(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(bounded, "SPILL_BYTES", 200)  # a spill every two records or so
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(tmp_path))
    kafka = _Transaction()
    output = _Output(kafka, {"job.by-n.repartition"})
    for n in range(10):
        output.produce(1, "out", b"v%d" % n + b"." * 60, b"k", [("h", b"1")], -1, n)
        output.produce(1, "job.by-n.repartition", b"r", b"k", None, 3, n)
    assert kafka.calls == []  # nothing in a transaction while the task runs
    assert output._spill is not None
    assert output.send(1) == 10
    assert kafka.calls[0] == ("begin", 1)
    produced = kafka.calls[1:]
    assert [c[3][:2] for c in produced] == [b"v%d" % n for n in range(10)]
    assert all(c[2] == "out" and c[4] == b"k" and c[5] == [("h", b"1")] for c in produced)
    assert [c[-1] for c in produced] == list(range(10))  # timestamps kept
    assert len(output.shuffled) == 10
    output.close()
    assert output._spill is None


def test_an_attempt_whose_ledger_committed_holds_nothing() -> None:
    output = _Output(None, set())
    output.produce(1, "out", b"v", None)
    assert output._held == [] and output._spill is None


def test_a_record_too_large_for_the_producer_is_a_dead_letter_not_a_failed_task() -> None:
    """Found by review: held without a size check, a Kafka sink's record over
    message.max.bytes was refused only when the held output was sent, after the task had run:
    every attempt of the task failed. Refused when produced (as the producer refuses it), it
    is the input's dead letter again."""
    from snapline.pipeline.record import Record
    from snapline.pipeline.runtime.transaction import TransactionalOutput
    from snapline.pipeline.sink import SinkContext
    from snapline.sinks.kafka import KafkaSink

    conf = {"bootstrap.servers": "127.0.0.1:1", "message.max.bytes": 10_000}
    kafka = TransactionalOutput(conf, transactional_id=None)  # produce() checks sizes itself
    output = _Output(kafka, set())
    dead: list[str] = []
    ctx = SinkContext("job", "t", "w", "kafka:out", output, lambda r, why, e: dead.append(why))
    writer = KafkaSink("out").open(ctx)
    writer.write_batch(
        [
            Record("x" * 50_000, 1, "in", 0, 1, "k", b"k", 0),
            Record("small", 2, "in", 0, 2, "k", b"k", 0),
        ],
        1,
    )
    assert len(dead) == 1 and "message.max.bytes" in dead[0]
    assert [held[1] for held in output._held] == [b'"small"']
