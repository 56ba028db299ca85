"""The record that flows through a task's operators, with its source position."""

from __future__ import annotations

from typing import Any

#: Record's constructor arguments but ``message``, in order.
_ARGS = (
    "value",
    "timestamp",
    "topic",
    "partition",
    "offset",
    "key",
    "key_bytes",
    "key_group",
    "raw",
    "raw_key",
)


class Record:
    """One element of a stream: a value plus where it came from.

    ``key``/``key_bytes``/``key_group`` are set by ``key_by``. The source position
    (topic, partition, offset) and the Kafka timestamp stay attached through every operator
    so dead letters and process functions can name them.
    """

    __slots__ = (
        "value",
        "key",
        "key_bytes",
        "key_group",
        "timestamp",
        "topic",
        "partition",
        "offset",
        "raw",
        "raw_key",
        "message",
    )

    def __init__(
        self,
        value: Any,
        timestamp: int,
        topic: str,
        partition: int,
        offset: int,
        key: Any = None,
        key_bytes: bytes | None = None,
        key_group: int = -1,
        raw: bytes | None = None,
        raw_key: bytes | None = None,
        message: Any = None,
    ) -> None:
        self.value = value
        self.timestamp = timestamp
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.key = key
        self.key_bytes = key_bytes
        self.key_group = key_group
        #: The original Kafka value and key bytes, for dead letters and partitioning checks.
        self.raw = raw
        self.raw_key = raw_key
        #: The Kafka message it came from, of a source or a repartition topic (None for
        #: timers and windows): a dead letter carries the input's headers, and a repartition
        #: writer sends them on.
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled and copied without ``message`` (a librdkafka message pickles not)."""
        return (Record, tuple(getattr(self, name) for name in _ARGS))

    def with_value(self, value: Any) -> Record:
        return Record(
            value,
            self.timestamp,
            self.topic,
            self.partition,
            self.offset,
            self.key,
            self.key_bytes,
            self.key_group,
            self.raw,
            self.raw_key,
            self.message,
        )

    def __repr__(self) -> str:
        return (
            f"Record(value={self.value!r}, key={self.key!r}, "
            f"at={self.topic}[{self.partition}]@{self.offset})"
        )


class BlankRecord(Record):
    """A ``Record`` made without a call of ``Record.__init__``: ``BlankRecord()`` has no field
    set, and its maker sets every one of ``Record.__slots__``. For the sources' per-message
    loops, where that Python call with 11 arguments cost ~1,400 of a keyed record's ~30,000
    instructions. Copies and pickles of it are plain ``Record``s."""

    __slots__ = ()
    __init__ = object.__init__


def dead_letter_headers(
    reason: str, topic: str, partition: int, offset: int, task_id: str
) -> list[tuple[str, bytes]]:
    """The Kafka headers of a dead letter: the error, the source position and the task (the
    services' tasks and the Spark runners write the same ones)."""
    return [
        ("snapline.error", reason.encode()[:4000]),
        ("snapline.topic", topic.encode()),
        ("snapline.partition", str(partition).encode()),
        ("snapline.offset", str(offset).encode()),
        ("snapline.task", task_id.encode()),
    ]


class ListedMessage:
    """A Kafka message held in a list (the testing harness, the Spark runner): the slice of
    ``confluent_kafka.Message`` that a task's source operators read."""

    __slots__ = ("_key", "_offset", "_partition", "_timestamp", "_topic", "_value")

    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        value: bytes | None,
        key: bytes | None,
        ts: int,
    ) -> None:
        self._topic, self._partition, self._offset = topic, partition, offset
        self._value, self._key, self._timestamp = value, key, ts

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> bytes | None:
        return self._key

    def offset(self) -> int:
        return self._offset

    def timestamp(self) -> tuple[int, int]:
        return (1, self._timestamp)

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def headers(self) -> None:
        return None

    def error(self) -> None:
        return None
