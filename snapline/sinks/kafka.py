"""The Kafka sink: output records go into the worker's transaction, which is the commit point."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.formats import FORMATS, encode_key, value_encoder
from snapline.pipeline.record import Record
from snapline.pipeline.sink import Sink, SinkContext, SinkWriter

VALUE_FORMATS = FORMATS
_TOO_LARGE = KafkaError.MSG_SIZE_TOO_LARGE


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
        if self.key is not None and not callable(self.key):
            raise ConfigurationError(
                f"KafkaSink key={self.key!r} is not a function: give a function of the output "
                f"value, e.g. key=lambda v: v[{self.key!r}]"
                if isinstance(self.key, str)
                else f"KafkaSink key={self.key!r} is not a function of the output value"
            )
        if self.value_format not in VALUE_FORMATS:
            raise ConfigurationError(
                f"KafkaSink value_format {self.value_format!r} is unknown; use one of "
                f"{list(VALUE_FORMATS)}"
            )
        if not self.name:
            object.__setattr__(self, "name", f"kafka:{self.topic}")

    def output_topics(self) -> dict[str, int | None]:
        return {self.topic: self.create_partitions}

    def open(self, context: SinkContext) -> SinkWriter:
        return KafkaSinkWriter(self, context)


class KafkaSinkWriter(SinkWriter):
    """Encodes and hands records to the worker's transactional output."""

    def __init__(self, sink: KafkaSink, context: SinkContext) -> None:
        self._topic = sink.topic
        self._key_fn = sink.key
        self._encode = value_encoder(sink.value_format)
        self._context = context
        self._produce = context.output.produce

    def write(self, record: Record, epoch: int) -> None:
        self.write_batch((record,), epoch)

    def write_batch(self, records: Sequence[Record], epoch: int) -> None:
        produce = self._produce
        encode = self._encode
        key_fn = self._key_fn
        topic = self._topic
        output = self._context.output
        producer = output.direct_producer(epoch)
        sent = 0
        for record in records:
            try:
                value = None if record.value is None else encode(record.value)
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
            if producer is not None:
                try:
                    producer.produce(topic, value, key)
                    sent += 1
                    continue
                except (BufferError, KafkaException):
                    pass  # the output waits for room, or says why the producer cannot go on
            try:
                produce(epoch, topic, value, key)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if not isinstance(error, KafkaError) or error.code() != _TOO_LARGE:
                    raise
                # Bad output, like a value the format cannot encode: the input goes to the
                # dead letters instead of the worker failing on it after every restart.
                self._context.dead_letter(
                    record,
                    f"{self._topic}: output too large for the producer ({error.str()}; raise "
                    "message.max.bytes in kafka_config, and the topic's max.message.bytes)",
                    epoch,
                )
        if sent:
            output.sent(sent)
