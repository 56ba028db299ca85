"""A task's operators: each takes a batch of records and pushes its output downstream.

Operators are built per task from the pipeline's nodes. Bad input (undecodable bytes,
user code raising) goes to the task's dead-letter handler with the reason; nothing is dropped
silently. ``on_barrier`` is called in topological order when the task's inputs are aligned.

Threads: the task thread runs every operator.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.formats import decoder, encode_key
from snapline.pipeline.functions import Context, KeyedProcessFunction
from snapline.pipeline.keygroups import state_key_prefix
from snapline.pipeline.record import Record
from snapline.pipeline.runtime.barrier import Barrier
from snapline.pipeline.sink import SinkWriter
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.descriptors import KeyScope, StateDescriptor

if TYPE_CHECKING:
    from snapline.connectors.kafka_source import KafkaSource
    from snapline.pipeline.runtime.task import Task


class Operator:
    """Base: forwards records and barriers to its downstream operators."""

    name = "operator"

    def __init__(self, task: Task, name: str) -> None:
        self.task = task
        self.name = name
        self.downstream: list[Operator] = []
        #: True when no other operator sees this operator's input records, so it may update
        #: them in place instead of copying (set by the task when it wires the graph).
        self.owns_input = False

    def emit(self, records: list[Record]) -> None:
        if records:
            for op in self.downstream:
                op.process(records)

    def process(self, records: list[Record]) -> None:
        self.emit(records)

    def on_barrier(self, barrier: Barrier) -> None:
        """The aligned barrier reaches this operator (its inputs are all before it)."""

    def close(self) -> None:
        """The task goes away."""


class SourceOperator(Operator):
    """Decodes raw Kafka messages into records."""

    def __init__(self, task: Task, name: str, source: KafkaSource) -> None:
        super().__init__(task, name)
        self._value = decoder(source.value_format)
        self._key = decoder(source.key_format)

    def process_messages(self, topic: str, partition: int, messages: Sequence[Any]) -> None:
        """Decode messages of one partition (a channel's chunk) and push them downstream."""
        decode_value = self._value
        decode_key = self._key
        out: list[Record] = []
        append = out.append
        for msg in messages:
            raw = msg.value()
            raw_key = msg.key()
            try:
                value = decode_value(raw)
                key = decode_key(raw_key)
            except Exception as exc:
                record = Record(
                    None,
                    msg.timestamp()[1],
                    topic,
                    partition,
                    msg.offset(),
                    raw=raw,
                    raw_key=raw_key,
                )
                self.task.dead_letter(record, f"{self.name}: cannot decode: {exc!r}")
                continue
            append(
                Record(
                    value,
                    msg.timestamp()[1],
                    topic,
                    partition,
                    msg.offset(),
                    key,
                    raw_key,
                    -1,
                    raw,
                    raw_key,
                )
            )
        self.emit(out)


class MapOperator(Operator):
    def __init__(self, task: Task, name: str, fn: Callable[[Any], Any]) -> None:
        super().__init__(task, name)
        self._fn = fn

    def process(self, records: list[Record]) -> None:
        fn = self._fn
        out: list[Record] = []
        in_place = self.owns_input
        for r in records:
            try:
                value = fn(r.value)
            except Exception as exc:
                self.task.dead_letter(r, f"{self.name} raised {exc!r}")
                continue
            if in_place:
                r.value = value
                out.append(r)
            else:
                out.append(r.with_value(value))
        self.emit(out)


class FilterOperator(Operator):
    def __init__(self, task: Task, name: str, fn: Callable[[Any], bool]) -> None:
        super().__init__(task, name)
        self._fn = fn

    def process(self, records: list[Record]) -> None:
        fn = self._fn
        out: list[Record] = []
        for r in records:
            try:
                if fn(r.value):
                    out.append(r)
            except Exception as exc:
                self.task.dead_letter(r, f"{self.name} raised {exc!r}")
        self.emit(out)


class FlatMapOperator(Operator):
    def __init__(self, task: Task, name: str, fn: Callable[[Any], Any]) -> None:
        super().__init__(task, name)
        self._fn = fn

    def process(self, records: list[Record]) -> None:
        fn = self._fn
        out: list[Record] = []
        for r in records:
            try:
                values = list(fn(r.value) or ())
            except Exception as exc:
                self.task.dead_letter(r, f"{self.name} raised {exc!r}")
                continue
            out.extend(r.with_value(v) for v in values)
        self.emit(out)


class KeyByOperator(Operator):
    """Sets key, key bytes and key-group; checks the input is partitioned by that key."""

    def __init__(
        self,
        task: Task,
        name: str,
        fn: Callable[[Any], Any] | None,
        max_parallelism: int,
        trust_partitioning: bool,
    ) -> None:
        super().__init__(task, name)
        self._fn = fn
        self._max_parallelism = max_parallelism
        self._check = not trust_partitioning

    def process(self, records: list[Record]) -> None:
        fn = self._fn
        maxp = self._max_parallelism
        crc = zlib.crc32
        in_place = self.owns_input
        out: list[Record] = []
        for r in records:
            try:
                key = r.key if fn is None else fn(r.value)
                key_bytes = encode_key(key)
            except Exception as exc:
                self.task.dead_letter(r, f"{self.name} raised {exc!r}")
                continue
            if key_bytes is None:
                self.task.dead_letter(r, f"{self.name} returned None as the key")
                continue
            if self._check and key_bytes != r.raw_key:
                raise ConfigurationError(
                    f"key_by produced key {key!r} but the record at {r.topic}[{r.partition}]@"
                    f"{r.offset} has Kafka key {r.raw_key!r}. Snapline needs the input topic "
                    "partitioned by the key_by key (produce the records with that key), because "
                    "repartitioning through an internal topic is not implemented yet. If the key "
                    "is a different but partition-consistent function of the Kafka key, pass "
                    "key_by(..., trust_partitioning=True)."
                )
            new = r if in_place else r.with_value(r.value)
            new.key = key
            new.key_bytes = key_bytes
            new.key_group = crc(key_bytes) % maxp
            out.append(new)
        self.emit(out)


class ProcessOperator(Operator):
    """Runs a keyed process function with its state bound to the task's backend."""

    def __init__(
        self,
        task: Task,
        name: str,
        function: KeyedProcessFunction,
        states: list[tuple[int, StateDescriptor]],
        backend: KeyedStateBackend,
    ) -> None:
        super().__init__(task, name)
        self._scope = KeyScope()
        self._function = copy.copy(function)
        for state_id, desc in states:
            assert desc.attribute is not None
            self._function.__dict__[desc.attribute] = desc.bind(backend, self._scope, state_id)
        self._ctx = Context(task.task_id)
        self._function.open(task.task_id)

    def process(self, records: list[Record]) -> None:
        scope = self._scope
        ctx = self._ctx
        process = self._function.process
        out: list[Record] = []
        append = out.append
        for r in records:
            key_bytes = r.key_bytes
            assert key_bytes is not None
            scope.prefix = state_key_prefix(r.key_group, key_bytes)
            scope.key = ctx.key = r.key
            ctx.timestamp = r.timestamp
            ctx.topic = r.topic
            ctx.partition = r.partition
            ctx.offset = r.offset
            try:
                produced = process(r.value, ctx)
                if produced is not None:
                    for value in produced:
                        append(r.with_value(value))
            except Exception as exc:
                self.task.dead_letter(r, f"{self.name} raised {exc!r}")
        scope.prefix = None
        self.emit(out)

    def on_barrier(self, barrier: Barrier) -> None:
        self.task.snapshot_state(barrier.checkpoint_id)

    def close(self) -> None:
        self._function.close()


class SinkOperator(Operator):
    """Hands records to the task's writer of one sink; pre-commits at the barrier."""

    def __init__(self, task: Task, name: str, writer: SinkWriter) -> None:
        super().__init__(task, name)
        self.writer = writer

    def process(self, records: list[Record]) -> None:
        self.writer.write_batch(records, self.task.epoch)

    def on_barrier(self, barrier: Barrier) -> None:
        self.task.sink_results[self.name] = self.writer.pre_commit(barrier.checkpoint_id)

    def close(self) -> None:
        self.writer.close()
