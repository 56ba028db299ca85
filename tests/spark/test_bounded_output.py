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
