"""A task's operators: each takes a batch of records and pushes its output downstream.

Operators are built per task from the pipeline's nodes. Bad input (undecodable bytes,
user code raising) goes to the task's dead-letter handler with the reason; nothing is dropped
silently. ``on_barrier`` is called in topological order when the task's inputs are aligned.

Threads: the task thread runs every operator.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from confluent_kafka import KafkaError, KafkaException

from snapline.pipeline.formats import bytes_decoder, encode_key
from snapline.pipeline.formats import tag_key as _tagged_key
from snapline.pipeline.formats import untag_key as _untag_key
from snapline.pipeline.functions import Context, KeyedCoProcessFunction, KeyedProcessFunction
from snapline.pipeline.keygroups import KEY_PREFIX, state_key_prefix
from snapline.pipeline.record import BlankRecord, Record
from snapline.pipeline.rolling import RollingAggregate, returned_none
from snapline.pipeline.runtime.barrier import Barrier
from snapline.pipeline.runtime.kafka_calls import kafka_error
from snapline.pipeline.runtime.timers import TimerService, processing_time_ms
from snapline.pipeline.runtime.watermarks import MIN_WATERMARK, WatermarkRecord, with_floors
from snapline.pipeline.sink import PreCommitResult, SinkWriter
from snapline.pipeline.stages import Repartition
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.descriptors import (
    EXACT_SERDES,
    PLAIN_INT_MAX,
    PLAIN_INT_MIN,
    KeyScope,
    StateDescriptor,
    is_plain,
)
from snapline.pipeline.state.serde import JsonSerde
from snapline.pipeline.state.timers import EVENT_TIME, PROCESSING_TIME, TimerState
from snapline.pipeline.time import timestamp_ms

if TYPE_CHECKING:
    from snapline.connectors.kafka_source import KafkaSource


class OperatorContext(Protocol):
    """What an operator may use of its task: the open epoch, dead letters, the task's Kafka
    output, the synchronous state snapshot, the sinks' pre-commit results and the task's
    event time (the task implements it; operators never see the worker)."""

    task_id: str
    epoch: int
    sink_results: dict[str, PreCommitResult]
    watermark: int

    @property
    def watermark_floors(self) -> Mapping[int, int]:
        """Key-group -> event time above ``watermark`` after a rescale (runtime/watermarks.py)."""
        ...

    @property
    def time_idle(self) -> bool: ...

    def on_watermark_record(self, tp: tuple[str, int], record: WatermarkRecord) -> None: ...

    def now_ms(self) -> int: ...

    def dead_letter(self, record: Record, reason: str, value: bytes | None = None) -> None: ...

    def snapshot_state(self, checkpoint_id: int) -> None: ...

    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        partition: int,
        timestamp: int,
        headers: Any = None,
    ) -> None: ...

    def direct_producer(self) -> Any: ...

    def sent(self, count: int) -> None: ...

    def fault_point(self, name: str) -> None: ...


class Operator:
    """Base: forwards records and barriers to its downstream operators."""

    name = "operator"

    def __init__(self, task: OperatorContext, name: str) -> None:
        self.task = task
        self.name = name
        self.downstream: list[Operator] = []
        #: This operator's event time: the task's watermark once ``on_watermark`` reached it.
        #: Records an upstream operator emits while it fires timers at a new watermark arrive
        #: before that (as in Flink, the watermark follows an operator's output downstream),
        #: so they are not late here.
        self.watermark: int = getattr(task, "watermark", MIN_WATERMARK)
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

    def on_watermark(self, watermark: int) -> None:
        """The task's watermark advanced (operators see it in topological order)."""

    def on_processing_time(self, now_ms: int) -> bool:
        """The wall clock is at ``now_ms``; True if processing-time timers fired."""
        return False

    def flush_state(self) -> None:
        """Write state values the operator holds back (write-back caches) to the backend:
        the task calls it before every snapshot of the backend."""

    def close(self) -> None:
        """The task goes away."""


def _bad_input(msg: Any, topic: str, partition: int, value: Any, ts: int) -> Record:
    """The record of a source message on its way to the dead letters (with its headers)."""
    return Record(
        value, ts, topic, partition, msg.offset(), raw=msg.value(), raw_key=msg.key(), message=msg
    )


class SourceOperator(Operator):
    """Decodes raw Kafka messages into records."""

    def __init__(self, task: OperatorContext, name: str, source: KafkaSource) -> None:
        super().__init__(task, name)
        self._value = bytes_decoder(source.value_format)
        self._key = bytes_decoder(source.key_format)
        self._timestamp = source.timestamp

    def process_messages(self, topic: str, partition: int, messages: Sequence[Any]) -> int | None:
        """Decode messages of one partition (a channel's chunk) and push them downstream;
        returns the largest event timestamp among them (None if none)."""
        decode_value = self._value
        decode_key = self._key
        timestamp_of = self._timestamp
        blank = BlankRecord
        max_ts: int | None = None
        out: list[Record] = []
        append = out.append
        for msg in messages:
            raw = msg.value()
            raw_key = msg.key()
            try:
                value = None if raw is None else decode_value(raw)
                key = None if raw_key is None else decode_key(raw_key)
            except Exception as exc:
                bad = _bad_input(msg, topic, partition, None, msg.timestamp()[1])
                self.task.dead_letter(bad, f"{self.name}: cannot decode: {exc!r}")
                continue
            ts = msg.timestamp()[1]
            if timestamp_of is not None:
                try:
                    ts = timestamp_ms(timestamp_of(value))
                except Exception as exc:
                    bad = _bad_input(msg, topic, partition, value, ts)
                    self.task.dead_letter(bad, f"{self.name}: timestamp raised {exc!r}")
                    continue
            if max_ts is None or ts > max_ts:
                max_ts = ts
            # Record(value, ts, topic, partition, msg.offset(), key, raw_key, -1, raw, raw_key,
            # msg), without the Python call of its __init__ (a test checks every slot is set).
            r = blank()
            r.value = value
            r.timestamp = ts
            r.topic = topic
            r.partition = partition
            r.offset = msg.offset()
            r.key = key
            r.key_bytes = raw_key
            r.key_group = -1
            r.raw = raw
            r.raw_key = raw_key
            r.message = msg
            append(r)
        self.emit(out)
        return max_ts


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
        raw_keys: bool = False,
    ) -> None:
        super().__init__(task, name)
        self._fn = fn
        self._max_parallelism = max_parallelism
        #: No function, and every record's ``key_bytes`` is its Kafka key as read, which
        #: equals ``encode_key(key)`` (string and bytes key formats).
        self._raw_keys = raw_keys

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
        if self._raw_keys and in_place:
            self._keep_kafka_keys(records)
            return
        out: list[Record] = []
        for r, key, key_bytes, group in self._keyed(records):
            new = r if in_place else r.with_value(r.value)
            new.key = key
            new.key_bytes = key_bytes
            new.key_group = group
            out.append(new)
        self.emit(out)

    def _keep_kafka_keys(self, records: list[Record]) -> None:
        """``key_by()`` of records that carry their Kafka key's bytes: only the key-group is
        new (one loop, no copies)."""
        maxp = self._max_parallelism
        crc = zlib.crc32
        keyless = False
        for r in records:
            key_bytes = r.key_bytes
            if key_bytes is None:
                self.task.dead_letter(r, f"{self.name}: the record has no key (key_by())")
                keyless = True
                continue
            r.key_group = crc(key_bytes) % maxp
        # The list is this operator's (it owns its input): it goes on as it is, unless some
        # records went to the dead letters.
        self.emit([r for r in records if r.key_bytes is not None] if keyless else records)


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
        forward_raw: bool = False,
    ) -> None:
        super().__init__(task, name, fn, max_parallelism)
        #: The records come straight from JSON sources: their Kafka bytes are their value
        #: encoded already, and cross the topic as read.
        self._forward_raw = forward_raw
        self._topic = repartition.topic
        self._partitions = partitions
        #: The (watermark, idle) last sent to every partition of the topic (None: not yet).
        self._sent: tuple[int, bool] | None = None

    def watermark_pending(self) -> bool:
        return self._sent != (self.task.watermark, self.task.time_idle)

    def process(self, records: list[Record]) -> None:
        produce = self.task.produce
        topic = self._topic
        partitions = self._partitions
        maxp = self._max_parallelism
        dumps = orjson.dumps
        producer = self.task.direct_producer()
        forward_raw = self._forward_raw
        sent = 0
        for r, key, key_bytes, group in self._keyed(records):
            try:
                value = r.raw if forward_raw else dumps(r.value)
            except TypeError as exc:
                self.task.dead_letter(
                    r, f"{self.name}: the value cannot cross the repartition topic as JSON: {exc}"
                )
                continue
            # The partition is repartition_partition(group, partitions, maxp), inlined.
            partition = group * partitions // maxp
            tagged = _tagged_key(key, key_bytes)
            ts = r.timestamp
            if ts <= 0:  # sent one lower: see from_wire_timestamp
                ts -= 1
            # The input's own headers cross with it: a dead letter of the next stage has them.
            message = r.message
            headers = None if message is None else message.headers()
            if producer is not None:
                try:
                    producer.produce(
                        topic, value, tagged, partition=partition, timestamp=ts, headers=headers
                    )
                    sent += 1
                    continue
                except (BufferError, KafkaException):
                    pass  # the output waits for room, or says why the producer cannot go on
            try:
                produce(topic, value, tagged, partition, ts, headers)
            except KafkaException as exc:
                error = _too_large(exc)
                if headers:  # the input's headers may make it too large: it goes without
                    try:
                        produce(topic, value, tagged, partition, ts)
                        continue
                    except KafkaException as again:
                        error = _too_large(again)
                self.task.dead_letter(
                    r,
                    f"{self.name}: the record is too large for the repartition topic "
                    f"({error.str()}; raise message.max.bytes in kafka_config)",
                )
        if sent:
            self.task.sent(sent)

    def on_barrier(self, barrier: Barrier) -> None:
        # The task's watermark reaches every downstream partition in this epoch's transaction,
        # behind the records it covers; downstream tasks take the minimum over the writers.
        current = (self.task.watermark, self.task.time_idle)
        if current != self._sent:
            record = WatermarkRecord(self.task.task_id, *current)
            key, value, now = record.key(), record.value(), processing_time_ms()
            for partition in range(self._partitions):
                self.task.produce(self._topic, value, key, partition, now)
            self._sent = current
        # The epoch's records are handed to the producer; the commit has not happened yet.
        self.task.fault_point("after_repartition_produce")


def _too_large(exc: KafkaException) -> KafkaError:
    """The error of a record over ``message.max.bytes``; any other is raised again."""
    error = kafka_error(exc)
    if error is None or error.code() != KafkaError.MSG_SIZE_TOO_LARGE:
        raise exc
    return error


def from_wire_timestamp(timestamp: int) -> int:
    """The event time a repartition record's Kafka timestamp carries. A producer reads
    timestamp 0 as "now", so ``RepartitionWriter`` sends event times <= 0 one lower (0 as -1,
    -1 as -2, ...) and this adds it back: every event time arrives as it was sent."""
    return timestamp if timestamp >= 0 else timestamp + 1


class RepartitionSource(Operator):
    """Reads a repartition topic: records arrive keyed (key, key bytes, key-group)."""

    def __init__(self, task: OperatorContext, name: str, max_parallelism: int) -> None:
        super().__init__(task, name)
        self._max_parallelism = max_parallelism

    def process_messages(self, topic: str, partition: int, messages: Sequence[Any]) -> None:
        maxp = self._max_parallelism
        crc = zlib.crc32
        loads = orjson.loads
        blank = BlankRecord
        out: list[Record] = []
        append = out.append
        for msg in messages:
            raw = msg.value()
            raw_key = msg.key()
            tag = None if raw_key is None else raw_key[:1]
            if tag == b"w":  # a control record, never data
                self.emit(out)  # the records before it, at the watermark they were sent with
                out = []
                append = out.append
                try:
                    mark = WatermarkRecord.decode(raw_key, raw)
                except Exception as exc:
                    bad = Record(None, -1, topic, partition, msg.offset(), raw=raw, raw_key=raw_key)
                    self.task.dead_letter(bad, f"{self.name}: bad watermark record: {exc!r}")
                    continue
                self.task.on_watermark_record((topic, partition), mark)
                continue
            try:
                if tag == b"s":  # untag_key(raw_key) for str keys, inlined
                    key_bytes = raw_key[1:]
                    key = key_bytes.decode()
                else:
                    key, key_bytes = _untag_key(raw_key)
                value = loads(raw)
            except Exception as exc:
                record = Record(
                    None,
                    from_wire_timestamp(msg.timestamp()[1]),
                    topic,
                    partition,
                    msg.offset(),
                    raw=raw,
                    raw_key=raw_key,
                    message=msg,
                )
                self.task.dead_letter(record, f"{self.name}: cannot decode: {exc!r}")
                continue
            ts = msg.timestamp()[1]
            if ts < 0:  # from_wire_timestamp, inlined
                ts += 1
            # Record(value, ts, topic, partition, msg.offset(), key, key_bytes, key-group,
            # raw, raw_key, msg) without its __init__'s Python call (as SourceOperator does).
            r = blank()
            r.value = value
            r.timestamp = ts
            r.topic = topic
            r.partition = partition
            r.offset = msg.offset()
            r.key = key
            r.key_bytes = key_bytes
            r.key_group = crc(key_bytes) % maxp
            r.raw = raw
            r.raw_key = raw_key
            r.message = msg
            append(r)
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
        max_parallelism: int,
    ) -> None:
        super().__init__(task, name)
        self._scope = KeyScope(write_back=True)
        self._function = copy.copy(function)
        self._timers: TimerService | None = None
        for state_id, desc in states:
            if isinstance(desc, TimerState):
                store = desc.bind(backend, self._scope, state_id)
                self._timers = TimerService(store, self._scope, max_parallelism, task.now_ms)
                continue
            assert desc.attribute is not None
            self._function.__dict__[desc.attribute] = desc.bind(backend, self._scope, state_id)
        self._ctx = Context(task.task_id)
        self._ctx.timers = self._timers
        #: Per key-group: (key length, KEY_PREFIX of the group and that length), the last one
        #: a record of the group needed.
        self._heads: list[tuple[int, bytes]] = [(-1, b"")] * max_parallelism
        self._function.open(task.task_id)

    def process(self, records: list[Record]) -> None:
        self._run(records, self._function.process)  # type: ignore[union-attr]

    def _run(self, records: list[Record], process: Callable[[Any, Context], Any]) -> None:
        floors = getattr(self.task, "watermark_floors", None)
        if floors:  # after a rescale: some key-groups' event time is further (watermarks.py)
            for watermark, run in with_floors(self.watermark, floors, records):
                self._run_at(run, process, watermark)
        else:
            self._run_at(records, process, self.watermark)

    def _run_at(
        self, records: list[Record], process: Callable[[Any, Context], Any], watermark: int
    ) -> None:
        scope = self._scope
        ctx = self._ctx
        ctx.watermark = watermark
        scope.now = self.task.now_ms()
        if self._timers is not None:
            self._timers.watermark = ctx.watermark
        pack_prefix = KEY_PREFIX.pack
        out: list[Record] = []
        append = out.append
        # The first output of a record may reuse its Record when no other operator sees the
        # input (dead letters carry the raw Kafka bytes, not ``value``).
        in_place = self.owns_input
        heads = self._heads
        for r in records:
            key_bytes: bytes = r.key_bytes  # type: ignore[assignment]
            # state_key_prefix(r.key_group, key_bytes), inlined (once per record), its header
            # packed once per key-group and key length.
            group = r.key_group
            size = len(key_bytes)
            head = heads[group]
            if head[0] != size or group < 0:
                head = heads[group] = (size, pack_prefix(group, size))
            scope.prefix = head[1] + key_bytes
            scope.key = ctx.key = r.key
            ctx.timestamp = r.timestamp
            ctx.topic = r.topic
            ctx.partition = r.partition
            ctx.offset = r.offset
            mark = -1
            value_in = r.value
            try:
                produced = process(value_in, ctx)
                if produced is not None:
                    mark = len(out)
                    reuse = in_place
                    for value in produced:
                        if reuse:
                            r.value = value
                            append(r)
                            reuse = False
                        else:
                            append(r.with_value(value))
            except Exception as exc:
                # A generator that yielded, then raised: the record is a dead letter, and
                # what it yielded before is not output too (it would be half of a result).
                if mark >= 0:
                    del out[mark:]
                    # Its first output may have taken the input's Record (in place): the dead
                    # letter is the input, not a half result (a timer's or window's result has
                    # no raw bytes, and its dead letter holds its value).
                    r.value = value_in
                self.task.dead_letter(r, f"{self.name} raised {exc!r}")
        scope.prefix = None
        self.emit(out)

    def on_barrier(self, barrier: Barrier) -> None:
        self.task.snapshot_state(barrier.checkpoint_id)

    def flush_state(self) -> None:
        self._scope.flush()

    def on_watermark(self, watermark: int) -> None:
        if self._timers is not None:
            self._timers.watermark = watermark
            self._fire(EVENT_TIME, watermark)

    def on_processing_time(self, now_ms: int) -> bool:
        timers = self._timers
        if timers is None:
            return False
        due = timers.next_processing_time()
        if due is None or due > now_ms:
            return False
        self._fire(PROCESSING_TIME, now_ms)
        return True

    def _fire(self, domain: int, limit: int) -> None:
        """Run ``on_timer`` for every timer of ``domain`` due at ``limit``; outputs carry the
        timer's time as their timestamp."""
        timers = self._timers
        assert timers is not None
        scope = self._scope
        ctx = self._ctx
        ctx.watermark = self.watermark
        scope.now = self.task.now_ms()
        ctx.time_domain = "event" if domain == EVENT_TIME else "processing"
        ctx.topic, ctx.partition, ctx.offset = "", -1, -1
        on_timer = self._function.on_timer
        out: list[Record] = []
        floors = getattr(self.task, "watermark_floors", None)
        for ts, group, key_bytes, key in timers.due(domain, limit):
            scope.prefix = state_key_prefix(group, key_bytes)
            scope.key = ctx.key = key
            if floors:  # the key's event time (watermarks.py), as for its records
                key_time = max(self.watermark, floors.get(group, self.watermark))
                ctx.watermark = timers.watermark = key_time
            ctx.timestamp = ts
            mark = len(out)
            try:
                produced = on_timer(ts, ctx)
                if produced is not None:
                    for value in produced:
                        out.append(Record(value, ts, "", -1, -1, key, key_bytes, group))
            except Exception as exc:
                del out[mark:]  # none of a failed firing's outputs, as for process()
                timer = Record(None, ts, f"timer:{self.name}", -1, -1, key, key_bytes, group)
                self.task.dead_letter(timer, f"{self.name}.on_timer({ts}) raised {exc!r}")
        scope.prefix = None
        ctx.time_domain = None
        self.emit(out)

    def close(self) -> None:
        self._function.close()


#: Decoded accumulators a ``RollingAggregateOperator`` keeps between epochs (about 250 bytes
#: each); beyond it the cache is emptied at the next chunk.
ROLLING_CACHE_ENTRIES = 50_000


#: Stale entries of a rolling aggregation's dirty list tolerated before it is compacted.
STALE_DIRTY = 1024


class RollingAggregateOperator(Operator):
    """``KeyedStream.count/reduce/aggregate`` (a ``RollingAggregate``) without a process
    function's per-record machinery (key scope, context, generator, state methods): the same
    state entries, encoded alike, and the same outputs and dead letters as a
    ``ProcessOperator`` running the function.

    Accumulators that are plain values (``is_plain``: numbers, ASCII strings, booleans, with
    the JSON or pickle serde) stay decoded in a cache keyed by the key's bytes, across epochs:
    an update marks the key dirty, and ``flush_state`` (before every snapshot) writes the dirty
    ones to the backend. The cache lives and dies with the task, and every restore builds a
    new task over a new backend, so it never holds a value the backend does not. Other
    accumulators (dicts, lists, other serdes) are read, decoded, encoded and written per
    record, as ``ValueState`` does. An aggregate with a ``ttl`` is not run here: the task runs
    its function in a ``ProcessOperator`` (``ValueState``'s expiry stamps)."""

    def __init__(
        self,
        task: OperatorContext,
        name: str,
        function: RollingAggregate,
        states: list[tuple[int, StateDescriptor]],
        backend: KeyedStateBackend,
    ) -> None:
        super().__init__(task, name)
        ((state_id, desc),) = [(sid, d) for sid, d in states if d is function.descriptor]
        self._sid = bytes([state_id])
        self._get = backend.get
        self._put = backend.put
        self._loads = desc.serde.loads
        self._dumps = desc.serde.dumps
        self._cacheable = type(desc.serde) in EXACT_SERDES
        self._json = type(desc.serde) is JsonSerde
        self._function = function
        #: Key bytes -> [stored key, decoded accumulator, generation] (plain values only).
        self._values: dict[bytes, list[Any]] = {}
        #: The entries updated since the last flush, each once: an entry is in it when its
        #: generation is ``_generation``, so a record of a key already dirty adds no entry
        #: and stores nothing in a dict (an entry written through gets generation -1).
        self._dirty: list[list[Any]] = []
        #: Entries of ``_dirty`` written through since (see ``_write_through``).
        self._stale = 0
        self._generation = 0

    def process(self, records: list[Record]) -> None:
        if len(self._values) > ROLLING_CACHE_ENTRIES:
            self.flush_state()
            self._values.clear()
        values = self._values
        mark_dirty = self._dirty.append
        generation = self._generation
        cacheable = self._cacheable
        function = self._function
        create, add, value_first, result = (
            function.create,
            function.add,
            function.value_first,
            function.result,
        )
        get, loads = self._get, self._loads
        pack_prefix = KEY_PREFIX.pack
        sid = self._sid
        out: list[Record] = []
        append = out.append
        in_place = self.owns_input
        for r in records:
            key_bytes: bytes = r.key_bytes  # type: ignore[assignment]
            value = r.value
            try:
                # function.fold(acc, value), inlined
                entry = values.get(key_bytes)
                if entry is None:
                    stored = pack_prefix(r.key_group, len(key_bytes)) + key_bytes + sid
                    raw = get(stored)
                    entry = [stored, None if raw is None else loads(raw), -1]
                acc = entry[1]
                if acc is None:
                    if create is None:
                        acc = value
                    else:
                        acc = add(value, create()) if value_first else add(create(), value)
                else:
                    acc = add(value, acc) if value_first else add(acc, value)
                if acc is None:
                    raise returned_none(function.what, r.key)
                out_value = {"key": r.key, "value": acc if result is None else result(acc)}
                # is_plain(acc), its int case inlined (counts and sums)
                if cacheable and (
                    PLAIN_INT_MIN <= acc <= PLAIN_INT_MAX if type(acc) is int else is_plain(acc)
                ):
                    entry[1] = acc
                    if entry[2] != generation:
                        entry[2] = generation
                        mark_dirty(entry)
                        values[key_bytes] = entry
                else:
                    self._write_through(key_bytes, entry, acc)
            except Exception as exc:
                self.task.dead_letter(r, f"{self.name} raised {exc!r}")
                continue
            if in_place:
                r.value = out_value
                append(r)
            else:
                append(r.with_value(out_value))
        self.emit(out)

    def _write_through(self, key_bytes: bytes, entry: list[Any], acc: Any) -> None:
        encoded = self._dumps(acc)  # first: if it raises, the cached value stays
        self._values.pop(key_bytes, None)
        was_dirty = entry[2] == self._generation
        entry[2] = -1  # the flush must not write its older cached value over this one
        self._put(entry[0], encoded)
        if was_dirty:
            # A key switching between plain and other accumulators adds an entry per record;
            # the stale ones are dropped once they outnumber the cached keys.
            self._stale += 1
            if self._stale > STALE_DIRTY and self._stale > len(self._values):
                generation = self._generation
                self._dirty[:] = [e for e in self._dirty if e[2] == generation]
                self._stale = 0

    def on_barrier(self, barrier: Barrier) -> None:
        self.task.snapshot_state(barrier.checkpoint_id)

    def flush_state(self) -> None:
        # The serde's dumps, not orjson.dumps: state must hold exact-size bytes (json_bytes).
        put, dumps, generation = self._put, self._dumps, self._generation
        if self._json:
            # An int's JSON is its decimal digits: b"%d" makes them (exact-size) without the
            # serde's Python call (counts and sums).
            for stored, acc, written in self._dirty:
                if written == generation:
                    put(stored, b"%d" % acc if type(acc) is int else dumps(acc))
        else:
            for stored, acc, written in self._dirty:
                if written == generation:
                    put(stored, dumps(acc))
        self._dirty.clear()
        self._stale = 0
        self._generation = generation + 1


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
