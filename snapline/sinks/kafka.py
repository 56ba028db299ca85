"""The Kafka sink: output records go into the worker's transaction, which is the commit point."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.record import Record
from snapline.sinks.base import Sink, SinkContext, SinkWriter

VALUE_FORMATS = ("json", "string", "bytes")


def encoder(fmt: str) -> Callable[[Any], bytes | None]:
    if fmt == "json":
        return lambda v: None if v is None else orjson.dumps(v)
    if fmt == "string":
        return lambda v: None if v is None else str(v).encode()
    if fmt == "bytes":
        return lambda v: v
    raise ConfigurationError(
        f"unknown Kafka value format {fmt!r}; use one of {list(VALUE_FORMATS)}"
    )


def encode_key(key: Any) -> bytes | None:
    """Kafka message keys: str as UTF-8, bytes as is, anything else as JSON."""
    if key is None:
        return None
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, bytes):
        return key
    return orjson.dumps(key)


@dataclass(frozen=True)
class KafkaSink(Sink):
    """Writes records to ``topic`` inside the worker's Kafka transaction.

    ``key``: a function of the output value giving the message key; by default the record's
    key (set by ``key_by``) is used, so output stays partitioned like the state.
    """

    topic: str
    key: Callable[[Any], Any] | None = None
    value_format: str = "json"
    create_partitions: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.topic, str) or not self.topic:
            raise ConfigurationError(f"KafkaSink needs a topic name, got {self.topic!r}")
        if self.value_format not in VALUE_FORMATS:
            raise ConfigurationError(
                f"KafkaSink value_format {self.value_format!r} is unknown; use one of "
                f"{list(VALUE_FORMATS)}"
            )
        if not self.name:
            object.__setattr__(self, "name", f"kafka:{self.topic}")

    def open(self, context: SinkContext) -> SinkWriter:
        return KafkaSinkWriter(self, context)


class KafkaSinkWriter(SinkWriter):
    """Encodes and hands records to the worker's transactional output."""

    def __init__(self, sink: KafkaSink, context: SinkContext) -> None:
        self._topic = sink.topic
        self._key_fn = sink.key
        self._encode = encoder(sink.value_format)
        self._context = context
        self._produce = context.output.produce

    def write(self, record: Record, epoch: int) -> None:
        self.write_batch((record,), epoch)

    def write_batch(self, records: Sequence[Record], epoch: int) -> None:
        produce = self._produce
        encode = self._encode
        key_fn = self._key_fn
        topic = self._topic
        for record in records:
            try:
                value = encode(record.value)
                if key_fn is None:
                    key = (
                        record.key_bytes if record.key_bytes is not None else encode_key(record.key)
                    )
                else:
                    key = encode_key(key_fn(record.value))
            except Exception as exc:  # a value the format cannot encode is bad input
                self._context.dead_letter(
                    record, f"{self._topic}: cannot encode output: {exc!r}", epoch
                )
                continue
            produce(epoch, topic, value, key)
