"""A re-keying ``key_by`` sends a record's Kafka headers on with it through the repartition
topic (a dead letter of the keyed stage carries them). The headers count against the
producer's ``message.max.bytes``: a record they would take over it crosses without them
rather than becoming a dead letter; one too large by itself is still a dead letter."""

from __future__ import annotations

from typing import Any

from snapline.pipeline.record import ListedMessage, Record
from snapline.pipeline.runtime.operators import RepartitionWriter
from snapline.pipeline.runtime.transaction import record_size, too_large
from snapline.pipeline.stages import Repartition

LIMIT = 1000


class _Headed(ListedMessage):
    """A source message with headers (``confluent_kafka.Message`` cannot be built here)."""

    __slots__ = ("_headers",)

    def __init__(self, offset: int, headers: list[tuple[str, bytes | None]] | None) -> None:
        super().__init__("in", 0, offset, b"{}", None, 5)
        self._headers = headers

    def headers(self) -> Any:
        return self._headers


class _Task:
    """The task as the writer sees it, with no direct producer: every record goes through
    ``produce``, which refuses what is over LIMIT as the transactional output does."""

    watermark = 0
    task_id = "p0"

    def __init__(self) -> None:
        self.produced: list[tuple[bytes | None, Any]] = []
        self.dead: list[str] = []

    def direct_producer(self) -> None:
        return None

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        partition: int,
        timestamp: int,
        headers: Any = None,
    ) -> None:
        size = record_size(value, key, headers)
        if size > LIMIT:
            raise too_large(size, LIMIT)
        self.produced.append((value, headers))

    def dead_letter(self, record: Record, reason: str, value: bytes | None = None) -> None:
        self.dead.append(reason)

    def sent(self, count: int) -> None:
        raise AssertionError("no record went straight to a producer")


def test_headers_cross_the_repartition_topic_unless_they_would_make_the_record_too_large() -> None:
    task = _Task()
    repartition = Repartition(1, "by-k", "job.by-k.repartition", 2, 0, 1)
    writer = RepartitionWriter(task, "by-k", lambda v: v["k"], 128, repartition, 2)  # type: ignore[arg-type]
    small = [("trace-id", b"t1"), ("empty", None)]
    big = [("blob", b"x" * 900)]
    records = [
        Record({"k": "a", "n": 1}, 5, "in", 0, 0, message=_Headed(0, small)),
        Record({"k": "a", "n": 2}, 5, "in", 0, 1, message=_Headed(1, None)),
        Record({"k": "b", "n": 3}, 5, "in", 0, 2),  # a timer's or window's: no message
        Record({"k": "b", "n": 4, "pad": "y" * 200}, 5, "in", 0, 3, message=_Headed(3, big)),
        Record({"k": "c", "pad": "z" * 1200}, 5, "in", 0, 4, message=_Headed(4, small)),
    ]
    writer.process(records)
    assert [headers for _, headers in task.produced] == [small, None, None, None]
    assert [value for value, _ in task.produced][3].startswith(b'{"k":"b","n":4')
    assert len(task.dead) == 1 and "too large for the repartition topic" in task.dead[0]
