"""A task's operators: each takes a batch of records and pushes its output downstream.

Operators are built per task from the pipeline's nodes. Bad input (undecodable bytes,
user code raising) goes to the task's dead-letter handler with the reason; nothing is dropped
silently. ``on_barrier`` is called in topological order when the task's inputs are aligned.

Threads: the task thread runs every operator.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from snapline.pipeline.formats import decoder, encode_key
from snapline.pipeline.functions import Context, KeyedCoProcessFunction, KeyedProcessFunction
from snapline.pipeline.keygroups import state_key_prefix
from snapline.pipeline.record import Record
from snapline.pipeline.runtime.barrier import Barrier
from snapline.pipeline.sink import PreCommitResult, SinkWriter
from snapline.pipeline.stages import Repartition, repartition_partition
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.descriptors import KeyScope, StateDescriptor

if TYPE_CHECKING:
    from snapline.connectors.kafka_source import KafkaSource


class OperatorContext(Protocol):
    """What an operator may use of its task: the open epoch, dead letters, the task's Kafka
    output, the synchronous state snapshot and the sinks' pre-commit results (the task
    implements it; operators never see the worker)."""

    task_id: str
    epoch: int
    sink_results: dict[str, PreCommitResult]

    def dead_letter(self, record: Record, reason: str, value: bytes | None = None) -> None: ...

    def snapshot_state(self, checkpoint_id: int) -> None: ...

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        partition: int,
        timestamp: int,
    ) -> None: ...

    def fault_point(self, name: str) -> None: ...


class Operator:
    """Base: forwards records and barriers to its downstream operators."""

    name = "operator"

    def __init__(self, task: OperatorContext, name: str) -> None:
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

    def __init__(self, task: OperatorContext, name: str, source: KafkaSource) -> None:
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
    def __init__(self, task: OperatorContext, name: str, fn: Callable[[Any], Any]) -> None:
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
    def __init__(self, task: OperatorContext, name: str, fn: Callable[[Any], bool]) -> None:
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
    def __init__(self, task: OperatorContext, name: str, fn: Callable[[Any], Any]) -> None:
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
    """Sets key, key bytes and key-group, for keyed state in this stage's tasks (the input is
    partitioned by that key: the Kafka message key, or ``trust_partitioning=True``)."""

    def __init__(
        self,
        task: OperatorContext,
        name: str,
        fn: Callable[[Any], Any] | None,
        max_parallelism: int,
    ) -> None:
        super().__init__(task, name)
        self._fn = fn
        self._max_parallelism = max_parallelism

    def _keyed(self, records: list[Record]) -> Iterable[tuple[Record, Any, bytes, int]]:
        """(record, key, key bytes, key-group) of each record whose key can be computed;
        the others go to the dead letters."""
        fn = self._fn
        maxp = self._max_parallelism
        crc = zlib.crc32
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
            yield r, key, key_bytes, crc(key_bytes) % maxp

    def process(self, records: list[Record]) -> None:
        in_place = self.owns_input
        out: list[Record] = []
        for r, key, key_bytes, group in self._keyed(records):
            new = r if in_place else r.with_value(r.value)
            new.key = key
            new.key_bytes = key_bytes
            new.key_group = group
            out.append(new)
        self.emit(out)


# The first byte of a repartition record's Kafka key says how the key bytes decode.
_KEY_STR, _KEY_BYTES, _KEY_JSON = b"s", b"b", b"j"


def _tagged_key(key: Any, key_bytes: bytes) -> bytes:
    tag = _KEY_STR if isinstance(key, str) else _KEY_BYTES if isinstance(key, bytes) else _KEY_JSON
    return tag + key_bytes


def _untag_key(raw_key: bytes) -> tuple[Any, bytes]:
    tag, key_bytes = raw_key[:1], raw_key[1:]
    if tag == _KEY_STR:
        return key_bytes.decode(), key_bytes
    if tag == _KEY_BYTES:
        return key_bytes, key_bytes
    if tag == _KEY_JSON:
        return orjson.loads(key_bytes), key_bytes
    raise ValueError(f"not a Snapline repartition key: {raw_key[:40]!r}")


class RepartitionWriter(KeyByOperator):
    """A re-keying ``key_by``: computes the key and produces the record to the repartition
    topic, in the partition that owns its key-group, inside the task's Kafka transaction.
    Values cross the topic as JSON (orjson); one that does not encode is a dead letter."""

    def __init__(
        self,
        task: OperatorContext,
        name: str,
        fn: Callable[[Any], Any] | None,
        max_parallelism: int,
        repartition: Repartition,
        partitions: int,
    ) -> None:
        super().__init__(task, name, fn, max_parallelism)
        self._topic = repartition.topic
        self._partitions = partitions

    def process(self, records: list[Record]) -> None:
        produce = self.task.produce
        topic = self._topic
        partitions = self._partitions
        maxp = self._max_parallelism
        dumps = orjson.dumps
        for r, key, key_bytes, group in self._keyed(records):
            try:
                value = dumps(r.value)
            except TypeError as exc:
                self.task.dead_letter(
                    r, f"{self.name}: the value cannot cross the repartition topic as JSON: {exc}"
                )
                continue
            produce(
                topic,
                value,
                _tagged_key(key, key_bytes),
                repartition_partition(group, partitions, maxp),
                r.timestamp,
            )

    def on_barrier(self, barrier: Barrier) -> None:
        # The epoch's records are handed to the producer; the commit has not happened yet.
        self.task.fault_point("after_repartition_produce")


class RepartitionSource(Operator):
    """Reads a repartition topic: records arrive keyed (key, key bytes, key-group)."""

    def __init__(self, task: OperatorContext, name: str, max_parallelism: int) -> None:
        super().__init__(task, name)
        self._max_parallelism = max_parallelism

    def process_messages(self, topic: str, partition: int, messages: Sequence[Any]) -> None:
        maxp = self._max_parallelism
        crc = zlib.crc32
        loads = orjson.loads
        out: list[Record] = []
        append = out.append
        for msg in messages:
            raw = msg.value()
            raw_key = msg.key()
            try:
                key, key_bytes = _untag_key(raw_key)
                value = loads(raw)
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
                    key_bytes,
                    crc(key_bytes) % maxp,
                    raw,
                    raw_key,
                )
            )
        self.emit(out)


class ProcessOperator(Operator):
    """Runs a keyed process function with its state bound to the task's backend."""

    def __init__(
        self,
        task: OperatorContext,
        name: str,
        function: KeyedProcessFunction | KeyedCoProcessFunction,
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
        self._run(records, self._function.process)  # type: ignore[union-attr]

    def _run(self, records: list[Record], process: Callable[[Any, Context], Any]) -> None:
        scope = self._scope
        ctx = self._ctx
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


class CoProcessOperator(ProcessOperator):
    """Runs a ``KeyedCoProcessFunction``: its two inputs arrive through ``side`` ports."""

    def side(self, left: bool) -> Operator:
        """The operator an upstream of the left (or right) input emits to."""
        fn = self._function
        assert isinstance(fn, KeyedCoProcessFunction)
        return _Side(self, fn.process_left if left else fn.process_right)


class _Side(Operator):
    def __init__(self, target: CoProcessOperator, process: Callable[[Any, Context], Any]) -> None:
        super().__init__(target.task, target.name)
        self._target = target
        self._process = process

    def process(self, records: list[Record]) -> None:
        self._target._run(records, self._process)


class SinkOperator(Operator):
    """Hands records to the task's writer of one sink; pre-commits at the barrier."""

    def __init__(self, task: OperatorContext, name: str, writer: SinkWriter) -> None:
        super().__init__(task, name)
        self.writer = writer
        #: Records handed to the sink (metrics: records out).
        self.records_out = 0

    def process(self, records: list[Record]) -> None:
        self.records_out += len(records)
        self.writer.write_batch(records, self.task.epoch)

    def on_barrier(self, barrier: Barrier) -> None:
        self.task.sink_results[self.name] = self.writer.pre_commit(barrier.checkpoint_id)

    def close(self) -> None:
        self.writer.close()
