"""The sinks and producer of the broker-free testing harness (``snapline.testing``): each keeps
what a worker's would have made visible, and refuses what a worker's would (a value a
``KafkaSink``'s format cannot encode, a row that does not fit a ``ParquetSink``'s table) as a
dead letter.

Threads: the caller's (the harness runs everything on it).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from snapline.pipeline.formats import encode_key, value_encoder
from snapline.pipeline.record import Record
from snapline.pipeline.sink import PreCommitResult, Sink, SinkContext, SinkWriter
from snapline.sinks.kafka import KafkaSink

if TYPE_CHECKING:
    from snapline.sinks.parquet import ParquetSink, RowConverter

#: What a task produced to a topic: (topic, value, key, headers, epoch).
_Produced = tuple[str, bytes | None, bytes | None, Any, int]


class _Output:
    """Stands in for the worker's producer; the dead-letter and repartition topics reach it
    (sinks are replaced). Exactly-once, records wait per epoch until their checkpoint commits
    (its transaction); at-least-once there is no transaction: each record is published as it
    is produced, and a crash does not take it back."""

    def __init__(self, publish: Callable[[_Produced], None], transactional: bool) -> None:
        self.by_epoch: dict[int, list[_Produced]] = defaultdict(list)
        self._publish = publish
        self._transactional = transactional

    def produce(
        self,
        epoch: int,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: Any = None,
        partition: int = -1,
        timestamp: int = 0,
    ) -> None:
        record = (topic, value, key, headers, timestamp)
        if self._transactional:
            self.by_epoch[epoch].append(record)
        else:
            self._publish(record)

    def direct_producer(self, epoch: int) -> None:
        """No producer: every record goes through ``produce``."""
        return None

    def take_committed(self, checkpoint_id: int) -> list[_Produced]:
        done = []
        for epoch in sorted(e for e in self.by_epoch if e <= checkpoint_id):
            done.extend(self.by_epoch.pop(epoch))
        return done


def _parquet_sink(sink: Sink) -> ParquetSink | None:
    """``sink`` if it is a ParquetSink. Its module (pyarrow) is imported only by a pipeline that
    declares one, so an instance exists only if the module is loaded."""
    parquet = sys.modules.get("snapline.sinks.parquet")
    return sink if parquet is not None and isinstance(sink, parquet.ParquetSink) else None


class _CapturingSink(Sink):
    """Replaces a declared sink: its writers keep the values the declared one would publish,
    in ``published``, and send what it would refuse to the dead letters. ``transactional``:
    the pipeline is exactly-once (a Kafka sink's values wait for their checkpoint)."""

    def __init__(
        self,
        name: str,
        published: list[Any],
        declared: Sink | None = None,
        transactional: bool = True,
    ) -> None:
        self.name = name
        self.published = published
        self.declared = declared
        self.transactional = transactional
        parquet = None if declared is None else _parquet_sink(declared)
        #: A ParquetSink's rows and schema, once known: declared, else inferred from the first
        #: rows, after which it outlives crashes and is every task's (its ``_schema.arrow``).
        self.converter: RowConverter | None = None
        if parquet is not None and parquet.schema is not None:
            from snapline.sinks.parquet import RowConverter

            self.converter = RowConverter(parquet.schema)

    def open(self, context: SinkContext) -> SinkWriter:
        if isinstance(self.declared, KafkaSink):
            return _KafkaCapture(self, context)
        if self.declared is not None and _parquet_sink(self.declared) is not None:
            return _ParquetCapture(self, context)
        return _CapturingWriter(self, context)


class _CapturingWriter(SinkWriter):
    """Keeps each epoch's values and publishes them when their checkpoint commits, as a
    two-phase-commit sink's writer does (Parquet, PostgreSQL, user sinks) at either
    guarantee: a worker calls ``pre_commit`` at the barrier and ``commit`` after the commit
    point, and a crash discards what it had not committed."""

    def __init__(self, sink: _CapturingSink, context: SinkContext) -> None:
        self._sink = sink
        self._context = context
        self._epochs: dict[int, list[Any]] = defaultdict(list)

    def write(self, record: Record, epoch: int) -> None:
        self.write_batch((record,), epoch)

    def write_batch(self, records: Sequence[Record], epoch: int) -> None:
        self._epochs[epoch].extend(r.value for r in records)

    def pre_commit(self, checkpoint_id: int) -> PreCommitResult:
        return None

    def commit(self, checkpoint_id: int) -> None:
        for epoch in sorted(e for e in self._epochs if e <= checkpoint_id):
            self._sink.published.extend(self._epochs.pop(epoch))


class _KafkaCapture(_CapturingWriter):
    """A KafkaSink's values: one its format or key function cannot encode is a dead letter, as
    KafkaSinkWriter sends it. Exactly-once they wait for their checkpoint (the transaction);
    at-least-once they are published as written (the producer's records)."""

    def __init__(self, sink: _CapturingSink, context: SinkContext) -> None:
        super().__init__(sink, context)
        declared = cast(KafkaSink, sink.declared)
        self._encode = value_encoder(declared.value_format)
        self._key_fn = declared.key
        self._topic = declared.topic

    def write_batch(self, records: Sequence[Record], epoch: int) -> None:
        encode, key_fn = self._encode, self._key_fn
        kept = self._epochs[epoch] if self._sink.transactional else self._sink.published
        for record in records:
            try:
                if record.value is not None:
                    encode(record.value)
                if key_fn is not None:
                    encode_key(key_fn(record.value))
            except Exception as exc:  # as KafkaSinkWriter: bad output is a dead letter
                self._context.dead_letter(
                    record, f"{self._topic}: cannot encode output: {exc!r}", epoch
                )
                continue
            kept.append(record.value)


class _ParquetCapture(_CapturingWriter):
    """A ParquetSink's rows, checked by the sink's own rules when its writer checks them
    (every CONVERT_CHUNK rows of an epoch, and at the barrier): a row whose partition
    directory would be too long, that is not a dict or does not fit the schema is a dead
    letter. The published values are the rows as written (not cast to the schema)."""

    def __init__(self, sink: _CapturingSink, context: SinkContext) -> None:
        super().__init__(sink, context)
        self._declared = cast("ParquetSink", sink.declared)
        self._unconverted: dict[int, list[Record]] = {}

    def write_batch(self, records: Sequence[Record], epoch: int) -> None:
        from snapline.sinks.parquet import CONVERT_CHUNK

        if not records:
            return
        pending = self._unconverted.setdefault(epoch, [])
        pending.extend(records)
        if len(pending) >= CONVERT_CHUNK:
            self._convert(epoch)

    def pre_commit(self, checkpoint_id: int) -> PreCommitResult:
        for epoch in sorted(e for e in self._unconverted if e <= checkpoint_id):
            self._convert(epoch)
        return None

    def _convert(self, epoch: int) -> None:
        """ParquetSinkWriter._convert's checks, with the functions it calls."""
        from snapline.sinks.parquet import _long_partition

        records = self._unconverted.pop(epoch, [])
        sink = self._declared
        columns = sink.partition_by
        if columns:
            kept = []
            for record in records:
                value = record.value
                reason = _long_partition(value, columns) if isinstance(value, dict) else None
                if reason is None:
                    kept.append(record)
                else:
                    self._context.dead_letter(record, f"{sink.name}: {reason}", epoch)
            records = kept
        if not records:
            return
        values = [r.value for r in records]
        converter = self._sink.converter or self._first_converter(values)
        _, rejected = converter.convert(values)
        for index, reason in rejected:
            self._context.dead_letter(records[index], f"{sink.name}: {reason}", epoch)
        refused = {index for index, _ in rejected}
        self._epochs[epoch].extend(v for i, v in enumerate(values) if i not in refused)

    def _first_converter(self, values: Sequence[Any]) -> RowConverter:
        """No schema yet: inferred from the first rows, as ParquetSinkWriter._first_converter."""
        from snapline.sinks.parquet import RowConverter, _check_schema, infer_schema

        sink = self._declared
        exclude = (sink.checkpoint_column,) if sink.checkpoint_column else ()
        schema = infer_schema(values, sink.partition_by, exclude)
        _check_schema(schema, sink.partition_by, sink.checkpoint_column, "inferred")
        self._sink.converter = RowConverter(schema)
        return self._sink.converter
