"""A poll during which a rebalance callback rebuilt the tasks (the pure logic of
``Worker._consume``, with an in-memory consumer): its batch is dropped and every partition is
rewound to the position its new task expects, so that no message is skipped.

Found by the 3-broker bounce test: after a failed checkpoint the worker polls once before
restoring (``_restore_after_failure``) and drops that poll's messages; when the poll ran
``on_lost`` and ``on_assign``, the messages it returned came from the new assignment and the
consumer's position was already past them, so 509 inputs were never processed.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from confluent_kafka import TopicPartition

from snapline.pipeline.runtime.worker import Worker


class _Message:
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self._tp, self._offset = (topic, partition), offset

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return self._tp[0]

    def partition(self) -> int:
        return self._tp[1]

    def offset(self) -> int:
        return self._offset


class _Consumer:
    """consume() runs a rebalance callback first (when given one), then returns messages."""

    def __init__(self, messages: list[_Message], callback: Any = None) -> None:
        self.messages, self.callback = messages, callback
        self.sought: list[tuple[str, int, int]] = []

    def consume(self, num: int, timeout: float) -> list[_Message]:
        if self.callback is not None:
            self.callback(self, [])
        return self.messages

    def seek(self, tp: TopicPartition) -> None:
        self.sought.append((tp.topic, tp.partition, tp.offset))


def _worker(consumer: _Consumer) -> Worker:
    worker = object.__new__(Worker)  # no broker: only what _consume reads
    worker.consumer = consumer
    worker._callback_error = None
    worker._consumer_fatal = None
    worker._rebalances = 0
    worker._paused = None
    worker.tasks = {}
    return worker


def _restored_task(topic: str, partition: int, position: int) -> Any:
    channel = SimpleNamespace(next_offset=position)
    return SimpleNamespace(channels={(topic, partition): channel})


def test_a_poll_that_rebuilt_the_tasks_drops_its_batch_and_rewinds() -> None:
    fetched = [_Message("orders", 3, offset) for offset in range(8898, 9406)]
    consumer = _Consumer(fetched)
    worker = _worker(consumer)

    def on_assign(_consumer: Any, _partitions: list[TopicPartition]) -> None:
        worker.tasks = {"p3": _restored_task("orders", 3, 8898)}

    consumer.callback = worker._guarded(on_assign)
    assert worker._consume(0.2) == []
    assert consumer.sought == [("orders", 3, 8898)]


def test_a_poll_without_a_rebalance_returns_its_batch() -> None:
    fetched = [_Message("orders", 3, offset) for offset in range(10, 20)]
    consumer = _Consumer(fetched)
    worker = _worker(consumer)
    worker.tasks = {"p3": _restored_task("orders", 3, 10)}
    assert worker._consume(0.05) == fetched
    assert consumer.sought == []
