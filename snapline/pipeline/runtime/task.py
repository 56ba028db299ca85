"""A task: one partition number of one stage (the stage's co-partitioned input topics share
it), its input channels, the stage's operators, its keyed state and its sink writers.

Flow of one record: the worker appends fetched messages to the task's channel for their
partition; ``run`` drains channels (round robin, in chunks) through the source operator and
down the operator graph. Flow of one barrier: ``inject_barrier(n)`` puts ``Barrier(n)`` at the
end of every channel and records the barrier positions; when a channel reaches it, the
aligner blocks that channel (exactly-once) until all channels reached it; then the barrier
passes every operator in topological order — keyed operators take the synchronous snapshot,
sinks pre-commit — and the task hands the checkpoint to the coordinator.

Flow of time (docs/time.md): after each chunk the task's ``TaskClock`` recomputes the
watermark (minimum over the channels, idle ones excluded); when it advances, every operator
sees ``on_watermark`` in topological order (keyed operators fire their event-time timers);
processing-time timers fire from ``run``. The clock's state travels in the task snapshot.

Threads: everything here runs on the worker's task thread.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from snapline.pipeline.errors import ConfigurationError, SnaplineError
from snapline.pipeline.graph import Node, Pipeline
from snapline.pipeline.record import Record, dead_letter_headers
from snapline.pipeline.rolling import RollingAggregate
from snapline.pipeline.runtime.barrier import Barrier, BarrierAligner
from snapline.pipeline.runtime.faults import FaultInjector
from snapline.pipeline.runtime.operators import (
    CoProcessOperator,
    FilterOperator,
    FlatMapOperator,
    KeyByOperator,
    MapOperator,
    Operator,
    ProcessOperator,
    RepartitionSource,
    RepartitionWriter,
    RollingAggregateOperator,
    SinkOperator,
    SourceOperator,
)
from snapline.pipeline.runtime.timers import processing_time_ms
from snapline.pipeline.runtime.transaction import TransactionalOutput, record_size
from snapline.pipeline.runtime.watermarks import (
    AtEnd,
    ChannelClock,
    SourceChannelClock,
    TaskClock,
    UpstreamChannelClock,
    WatermarkRecord,
)
from snapline.pipeline.sink import PreCommitResult, SinkContext
from snapline.pipeline.stages import SOURCE_STAGE, Stage, StagePlan, task_id_for
from snapline.pipeline.state.backend import KeyedStateBackend, SnapshotHandle
from snapline.pipeline.state.descriptors import expired_entries

log = logging.getLogger(__name__)

TopicPartitionKey = tuple[str, int]
#: What comes before a task id (``p3``, ``s1-p3``) in the name of a task that has a prefix.
_TASK_ID_PREFIX = re.compile(r"^(.*?)(?:s\d+-)?p\d+$")
#: Records processed from one channel before the task looks at the next one.
CHUNK = 512


class UserCodeError(SnaplineError):
    """User code raised (or a record was undecodable) and the pipeline says on_error='fail'."""


@dataclass
class Channel:
    """Fetched but not yet processed messages of one source partition, and barriers."""

    tp: TopicPartitionKey
    next_offset: int
    items: deque[Any] = field(default_factory=deque)


@dataclass
class TaskSnapshot:
    """What a task hands to the coordinator when barrier n has passed all its operators."""

    task_id: str
    checkpoint_id: int
    positions: dict[TopicPartitionKey, int]
    state: SnapshotHandle | None
    sinks: dict[str, PreCommitResult]
    #: Seconds the synchronous part took (operators' barrier handling: state snapshot, sink
    #: pre-commit), for the checkpoint history and metrics.
    sync_seconds: float = 0.0
    #: The task's clock (watermarks per channel): restored with the checkpoint.
    time: dict[str, Any] | None = None
    #: The tasks of its keyed stage (None: the source stage), which key-group ranges follow.
    task_count: int | None = None
    #: Id of each topic the task reads (the worker checked them at restore): its positions
    #: are offsets of those topics.
    topic_ids: dict[str, str] = field(default_factory=dict)


class Task:
    """See module docstring."""

    def __init__(
        self,
        task_id: str,
        pipeline: Pipeline,
        positions: dict[TopicPartitionKey, int],
        backend: KeyedStateBackend,
        output: TransactionalOutput,
        *,
        worker_id: str,
        epoch: int,
        on_snapshot: Callable[[TaskSnapshot], None],
        faults: FaultInjector,
        cluster_id: str = "",
        stage: int = SOURCE_STAGE,
        plan: StagePlan | None = None,
        topic_partitions: dict[str, int] | None = None,
        time_state: dict[str, Any] | None = None,
        clock: Callable[[], int] = processing_time_ms,
        ttl_sweep_interval: float = 60.0,
        source_ends: AtEnd = None,
        topic_ids: dict[str, str] | None = None,
    ) -> None:
        self.task_id = task_id
        #: Id of each topic it reads, recorded in its checkpoints (worker._recreated_topics).
        self.topic_ids = topic_ids or {}
        self.pipeline = pipeline
        self.plan = plan if plan is not None else pipeline.stages()
        self.stage: Stage = self.plan.stages[stage]
        #: Partitions of each repartition topic (the worker's topic plan; 1 when unknown).
        self._topic_partitions = topic_partitions or {}
        self.cluster_id = cluster_id
        self.backend = backend
        self.output = output
        self.epoch = epoch
        self._on_snapshot = on_snapshot
        self._faults = faults
        self._fail_on_error = pipeline.on_error == "fail"
        self.channels = {tp: Channel(tp, offset) for tp, offset in positions.items()}
        self._channel_list = list(self.channels.values())
        self.aligner = BarrierAligner(self.channels, exactly_once=pipeline.exactly_once)
        self._barrier_positions: dict[int, dict[TopicPartitionKey, int]] = {}
        self._state_snapshot: tuple[int, SnapshotHandle] | None = None
        self.sink_results: dict[str, PreCommitResult] = {}
        self.records_in = 0
        self.dead_letters = 0
        self.operators: list[Operator] = []
        self.sources: dict[str, SourceOperator | RepartitionSource] = {}
        self.sink_writers: dict[str, SinkOperator] = {}
        #: Processing time in ms (timers, state TTL); the testing harness may replace it.
        self.now_ms = clock
        self._ttls = {
            sid: desc.ttl_ms
            for entries in pipeline.state_ids().values()
            for sid, desc in entries
            if desc.ttl_ms is not None
        }
        self._ttl_sweep_interval = ttl_sweep_interval
        self._last_ttl_sweep = time.monotonic()
        #: Asks Kafka whether a source partition is read to its end before its channel is
        #: called idle (runtime/source_ends.py); None: no Kafka, local silence decides.
        self.source_ends = source_ends
        self.clock = TaskClock(self._channel_clocks())
        self.clock.restore(time_state)
        #: The task's event-time watermark (never decreasing) and whether all inputs are idle.
        self.watermark = self.clock.watermark
        #: Timers fired or the watermark moved since the last barrier (the worker checkpoints
        #: even when nothing was read, so that the outputs and watermarks get committed).
        self._time_moved = False
        self._build(worker_id)

    @property
    def task_count(self) -> int | None:
        """The tasks of this keyed stage (its repartition topics' partitions), which its
        key-group range follows; None for the source stage."""
        if self.stage.index == SOURCE_STAGE or not self.stage.reads:
            return None
        return self._topic_partitions.get(self.stage.reads[0])

    @property
    def late_dropped(self) -> int:
        """Late records its windows dropped (``on_late="drop"``) since the task was built;
        read by the metrics and the testing harness, like ``dead_letters``."""
        return sum(getattr(op, "late_dropped", 0) for op in self.operators)

    @property
    def watermark_floors(self) -> dict[int, int]:
        """Key-group -> event time above ``watermark`` (after a rescale: runtime/watermarks.py)."""
        return self.clock.floors

    def _channel_clocks(self) -> dict[TopicPartitionKey, ChannelClock]:
        sources = {t: s for s in self.pipeline.sources() for t in s.topic_list}
        now = time.monotonic()
        clocks: dict[TopicPartitionKey, ChannelClock] = {}
        for tp in self.channels:
            source = sources.get(tp[0])
            if source is not None:
                ooo = source.max_out_of_orderness
                assert isinstance(ooo, int)
                idle = source.idle_timeout
                assert idle is None or isinstance(idle, float)
                clocks[tp] = SourceChannelClock(ooo, idle, now, tp)
            else:
                clocks[tp] = UpstreamChannelClock(self._upstream_writers(tp[0]))
        return clocks

    def _upstream_writers(self, topic: str) -> frozenset[str]:
        """The tasks that write watermarks into ``topic``: the upstream stage's partitions."""
        for rep in self.plan.repartitions.values():
            if rep.topic == topic:
                upstream = self.plan.stages[rep.upstream]
                reads = (
                    self.pipeline.source_topics()
                    if upstream.index == SOURCE_STAGE
                    else list(upstream.reads)
                )
                count = max((self._topic_partitions.get(t, 1) for t in reads), default=1)
                # Writers are named like this task: a Spark run's tasks are
                # "spark-<run>-<task id>" (their watermark records were all ignored).
                prefix = _TASK_ID_PREFIX.match(self.task_id)
                head = prefix.group(1) if prefix else ""
                return frozenset(head + task_id_for(upstream.index, p) for p in range(count))
        return frozenset()

    # ------------------------------------------------------------------ building
    def _build(self, worker_id: str) -> None:
        """The operators of this task's stage, wired like the graph. A re-keying key_by is a
        writer in the stage before its topic and a source in the stage after it."""
        pipeline = self.pipeline
        states = pipeline.state_ids()
        stage = self.stage.index
        by_node: dict[int, Operator] = {}
        wired: list[Node] = []
        for node in pipeline.nodes:  # nodes are in topological order by construction
            rep = self.plan.repartitions.get(node.id)
            if rep is not None and rep.downstream == stage:
                source = RepartitionSource(self, node.name, pipeline.max_parallelism)
                self.sources[rep.topic] = source
                by_node[node.id] = source
                self.operators.append(source)
                continue
            if node.id not in self.stage.node_ids:
                continue
            op = self._operator_for(node, states, worker_id)
            by_node[node.id] = op
            self.operators.append(op)
            wired.append(node)
            if isinstance(op, CoProcessOperator):
                left, right = node.inputs
                by_node[left.id].downstream.append(op.side(left=True))
                by_node[right.id].downstream.append(op.side(left=False))
                continue
            for upstream in node.inputs:
                by_node[upstream.id].downstream.append(op)

        def exclusive(node: Node) -> bool:
            """The records ``node`` emits reach one operator only. A filter or a union emits
            the very records it was given: theirs are exclusive only if its inputs' were."""
            if len(by_node[node.id].downstream) != 1:
                return False
            return node.kind not in ("filter", "union") or all(exclusive(u) for u in node.inputs)

        for node in wired:
            op = by_node[node.id]
            # An operator that owns its input may write its output into the input's Record.
            op.owns_input = bool(node.inputs) and all(exclusive(u) for u in node.inputs)

    def _operator_for(self, node: Node, states: dict[int, Any], worker_id: str) -> Operator:
        kind = node.kind
        if kind == "source":
            op = SourceOperator(self, node.name, node.fn)
            for topic in node.fn.topic_list:
                self.sources[topic] = op
            return op
        if kind == "map":
            return MapOperator(self, node.name, node.fn)
        if kind == "filter":
            return FilterOperator(self, node.name, node.fn)
        if kind == "flat_map":
            return FlatMapOperator(self, node.name, node.fn)
        if kind == "key_by":
            rep = self.plan.repartitions.get(node.id)
            if rep is not None:
                return RepartitionWriter(
                    self,
                    node.name,
                    node.fn,
                    self.pipeline.max_parallelism,
                    rep,
                    self._topic_partitions.get(rep.topic, 1),
                    forward_raw=_reads_json_source(node),
                )
            return KeyByOperator(
                self,
                node.name,
                node.fn,
                self.pipeline.max_parallelism,
                raw_keys=node.fn is None and _kafka_keys_are_raw(node),
            )
        maxp = self.pipeline.max_parallelism
        if (
            kind == "process"
            and isinstance(node.fn, RollingAggregate)
            and node.fn.descriptor.ttl_ms is None  # with a TTL: ValueState's stamps and expiry
        ):
            return RollingAggregateOperator(self, node.name, node.fn, states[node.id], self.backend)
        if kind == "process":
            return ProcessOperator(self, node.name, node.fn, states[node.id], self.backend, maxp)
        if kind == "co_process":
            return CoProcessOperator(self, node.name, node.fn, states[node.id], self.backend, maxp)
        if kind == "window":
            from snapline.pipeline.runtime.window_operator import WindowOperator

            return WindowOperator(self, node.name, node.fn, states[node.id], self.backend, maxp)
        if kind == "union":
            return Operator(self, node.name)
        if kind == "sink":
            context = SinkContext(
                self.pipeline.name,
                self.task_id,
                worker_id,
                node.fn.name,
                self.output,
                self._sink_dead_letter,
                self.cluster_id,
                self._faults.point,
            )
            sink_op = SinkOperator(self, node.fn.name, node.fn.open(context))
            self.sink_writers[node.fn.name] = sink_op
            return sink_op
        raise ConfigurationError(f"unknown node kind {kind!r}")

    # ------------------------------------------------------------------ input
    def enqueue(self, tp: TopicPartitionKey, messages: list[Any]) -> None:
        channel = self.channels[tp]
        channel.items.append(messages)
        channel.next_offset = messages[-1].offset() + 1
        self.records_in += len(messages)

    def inject_barrier(self, checkpoint_id: int) -> None:
        """Trigger: barrier n goes behind the last fetched record of every channel."""
        positions = {}
        barrier = Barrier(checkpoint_id)
        for channel in self._channel_list:
            channel.items.append(barrier)
            positions[channel.tp] = channel.next_offset
        self._barrier_positions[checkpoint_id] = positions

    @property
    def backlog(self) -> int:
        return sum(len(c.items) for c in self._channel_list)

    def run(self, advance_time: bool = True) -> None:
        """Process until every channel is empty or blocked by alignment. ``advance_time``
        False: the clock moves only with the records processed (no idleness, no
        processing-time timers): a savepoint's final checkpoint, whose next epoch must stay
        empty while the job pauses."""
        channels = self._channel_list
        aligner = self.aligner
        single = len(channels) == 1
        progress = True
        while progress:
            progress = False
            for channel in channels:
                items = channel.items
                if not items or aligner.is_blocked(channel.tp):
                    continue
                item = items[0]
                progress = True
                if isinstance(item, Barrier):
                    items.popleft()
                    released = aligner.on_barrier(channel.tp, item)
                    if released is not None:
                        self._on_aligned(released)
                    continue
                if single or len(item) <= CHUNK:
                    items.popleft()
                    chunk = item
                else:
                    chunk, items[0] = item[:CHUNK], item[CHUNK:]
                topic, partition = channel.tp
                max_ts = self.sources[topic].process_messages(topic, partition, chunk)
                now = time.monotonic()
                self.clock.observe(channel.tp, max_ts, now)
                self._advance_time(now)
        if advance_time:
            self._advance_time(time.monotonic())
            self._fire_processing_time()

    # ------------------------------------------------------------------ time
    @property
    def time_idle(self) -> bool:
        """Every input of the task is idle (its watermark then holds nobody back)."""
        return self.clock.idle

    @property
    def time_pending(self) -> bool:
        """Time moved (timers fired, watermark changed) since the last barrier: worth a
        checkpoint even if nothing was read."""
        return self._time_moved or any(
            isinstance(op, RepartitionWriter) and op.watermark_pending() for op in self.operators
        )

    def _advance_time(self, now: float) -> None:
        backlog = {c.tp: bool(c.items) for c in self._channel_list}
        idle = self.clock.idle
        if self.clock.advance(now, backlog, self.source_ends):
            self._set_watermark(self.clock.watermark)
        elif idle != self.clock.idle:
            self._time_moved = True

    def _set_watermark(self, watermark: int) -> None:
        self.watermark = watermark
        self._time_moved = True
        for op in self.operators:  # in graph order: each sees its upstream's output first
            op.watermark = watermark
            op.on_watermark(watermark)

    def _fire_processing_time(self) -> None:
        now_ms = self.now_ms()
        for op in self.operators:
            if op.on_processing_time(now_ms):
                self._time_moved = True

    def on_watermark_record(self, tp: TopicPartitionKey, record: WatermarkRecord) -> None:
        """An upstream task's watermark read from a repartition channel."""
        self.clock.upstream(tp, record)

    def end_of_input(self) -> None:
        """The input is bounded and ended (the testing harness): all event time passed."""
        self.clock.end_of_input()
        self._set_watermark(self.clock.watermark)

    # ------------------------------------------------------------------ barriers
    def _on_aligned(self, barrier: Barrier) -> None:
        n = barrier.checkpoint_id
        sync_started = time.monotonic()
        self.sink_results = {}
        self._state_snapshot = None
        for op in self.operators:
            op.on_barrier(barrier)
        state = self._state_snapshot[1] if self._state_snapshot is not None else None
        self._faults.point("sync_snapshot")
        self.epoch = n + 1
        self._on_snapshot(
            TaskSnapshot(
                self.task_id,
                n,
                self._barrier_positions.pop(n),
                state,
                self.sink_results,
                sync_seconds=time.monotonic() - sync_started,
                time=self.clock.snapshot(),
                task_count=self.task_count,
                topic_ids=self.topic_ids,
            )
        )
        self._time_moved = False
        self.sink_results = {}

    def snapshot_state(self, checkpoint_id: int) -> None:
        """Synchronous part of the state snapshot, once per barrier for the task's backend."""
        if self._state_snapshot is None or self._state_snapshot[0] != checkpoint_id:
            for op in self.operators:
                op.flush_state()
            self._sweep_expired_state()
            self._state_snapshot = (checkpoint_id, self.backend.snapshot(checkpoint_id))

    def _sweep_expired_state(self) -> None:
        """State TTL: expired entries are invisible at once (descriptors check on read); here
        they are removed physically, at most every ``ttl_sweep_interval`` s, before a
        snapshot so that checkpoints do not carry them."""
        now = time.monotonic()
        if self._ttls and now - self._last_ttl_sweep >= self._ttl_sweep_interval:
            self._last_ttl_sweep = now
            removed = self.backend.delete_where(expired_entries(self._ttls, self.now_ms()))
            log.debug("task %s: %d expired state entries removed", self.task_id, removed)

    # ------------------------------------------------------------------ after commit
    def notify_committed(self, checkpoint_id: int) -> None:
        for sink_op in self.sink_writers.values():
            sink_op.writer.commit(checkpoint_id)

    def recover_sinks(self, committed: int | None, metadata: dict[str, dict[str, Any]]) -> None:
        for name, sink_op in self.sink_writers.items():
            sink_op.writer.recover(committed, metadata.get(name))

    def sink_checkpoint_ids_above(self) -> int | None:
        """The highest ``checkpoint_ids_above`` of the task's sinks (after ``recover_sinks``)."""
        bounds = [w.writer.checkpoint_ids_above() for w in self.sink_writers.values()]
        return max((b for b in bounds if b is not None), default=None)

    def abort_sinks(self, checkpoint_id: int) -> None:
        for sink_op in self.sink_writers.values():
            sink_op.writer.abort(checkpoint_id)

    def close(self) -> None:
        for op in self.operators:
            try:
                op.close()
            except Exception:  # closing must not hide the error that brought us here
                log.exception("closing %s of task %s", op.name, self.task_id)
        self.backend.close()

    # ------------------------------------------------------------------ operator context
    def produce(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        partition: int,
        timestamp: int,
        headers: Any = None,
    ) -> None:
        """A record into this epoch's transaction (repartition topics)."""
        self.output.produce(self.epoch, topic, value, key, headers, partition, timestamp)

    def direct_producer(self) -> Any:
        """The Kafka producer when this epoch's records may go straight to it (see
        ``TransactionalOutput.direct_producer``), else None."""
        return self.output.direct_producer(self.epoch)

    def sent(self, count: int) -> None:
        """``count`` records went straight to the producer."""
        self.output.sent(count)

    def fault_point(self, name: str) -> None:
        self._faults.point(name)

    # ------------------------------------------------------------------ bad input
    def dead_letter(self, record: Record, reason: str, value: bytes | None = None) -> None:
        """Send ``record`` to the dead-letter topic (in this epoch's transaction) or fail.

        The dead letter carries the original Kafka bytes (or ``value``, e.g. the row a sink
        rejected), the input's own headers (of a record read from a source topic, or from a
        repartition topic, which carries its input's), then
        headers naming the error and the source position.
        """
        if self._fail_on_error:
            raise UserCodeError(
                f"{reason} at {record.topic}[{record.partition}]@{record.offset} "
                "(pipeline on_error='fail'; use on_error='dead_letter' to divert such records)"
            )
        self.dead_letters += 1
        if value is None:
            value = record.raw
            if value is None and record.value is not None:
                # A window's or timer's result, refused by the operator or sink after it:
                # there is no input record behind it, and its state is gone once it fired.
                value, reason = self._result_bytes(record, reason)
        log.warning(
            "dead letter %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason
        )
        headers = dead_letter_headers(
            reason, record.topic, record.partition, record.offset, self.task_id
        )
        message = record.message
        given = None if message is None else message.headers()
        if given:
            whole = given + headers  # Snapline's last: a reader taking the last wins
            if self._fits(value, record.raw_key, whole) or (
                # the value is left out anyway (below): the input's headers still go
                not self._fits(value, record.raw_key, headers)
                and self._fits(None, record.raw_key, whole)
            ):
                headers = whole
            else:
                omitted = f"{len(given)} input headers, over the producer's message.max.bytes"
                headers.append(("snapline.headers-omitted", omitted.encode()))
        if not self._fits(value, record.raw_key, headers):
            # Even the input is too large for the producer: the dead letter names its
            # source position (where the input still is) and leaves the bytes out.
            size = 0 if value is None else len(value)
            headers.append(
                (
                    "snapline.value-omitted",
                    f"{size} bytes, over the producer's message.max.bytes".encode(),
                )
            )
            value = None
        self.output.produce(
            self.epoch, self.pipeline.dead_letter_topic, value, record.raw_key, headers
        )

    def _fits(self, value: bytes | None, key: bytes | None, headers: Any) -> bool:
        """Whether the producer takes a record of this size (``message.max.bytes``)."""
        limit = getattr(self.output, "max_message_bytes", None)
        return limit is None or record_size(value, key, headers) <= limit

    def _sink_dead_letter(self, record: Record, reason: str, epoch: int) -> None:
        """A sink refused ``record``: the dead letter carries the row it refused, or the
        input record when that row is too large for a Kafka record itself (a result with no
        input record: as much of the row as fits, ``_result_bytes``)."""
        row = _row_bytes(record.value)
        # The reason and source position headers make up most of a dead letter's headers.
        headers = dead_letter_headers(reason, record.topic, 0, 0, self.task_id)
        if self._fits(row, record.raw_key, headers):
            self.dead_letter(record, reason, row)
            return
        if record.raw is not None:
            reason += "; the dead letter holds the input record (the output is too large)"
        self.dead_letter(record, reason)  # record.raw, else the row cut to fit

    def _result_bytes(self, record: Record, reason: str) -> tuple[bytes, str]:
        """The dead letter's value for a result with no input record (a window's or timer's)
        and its reason: the result's bytes, or as much of them as the producer takes, its key
        and window first."""
        row = _row_bytes(record.value)
        headers = dead_letter_headers(
            reason, record.topic, record.partition, record.offset, self.task_id
        )
        if self._fits(row, record.raw_key, headers):
            return row, reason
        limit = getattr(self.output, "max_message_bytes", None) or len(row)
        keep = max(0, limit // 2)
        return row[:keep], (
            f"{reason}; the output ({len(row)} bytes) is too large for the producer: the dead "
            f"letter holds its first {keep} bytes"
        )


_PASS_THROUGH = ("map", "filter", "flat_map", "union")


def _row_bytes(value: Any) -> bytes:
    """A result's bytes in a dead letter: JSON (what is not JSON as its ``str``), else its
    ``repr``."""
    try:
        return orjson.dumps(value, default=str)
    except TypeError:
        return repr(value).encode()


def _kafka_keys_are_raw(node: Node) -> bool:
    """True when every record reaching ``node`` carries its Kafka message key as read, from
    sources whose key format makes the key's bytes the message key's bytes ("string",
    "bytes"): ``key_by()`` without a function can then take ``key_bytes`` as they are."""
    for upstream in node.inputs:
        if upstream.kind == "source":
            if upstream.fn.key_format not in ("string", "bytes"):
                return False
        elif upstream.kind not in _PASS_THROUGH or not _kafka_keys_are_raw(upstream):
            return False
    return bool(node.inputs)


def _reads_json_source(node: Node) -> bool:
    """True when ``node`` reads straight from JSON sources, so each record's value is its
    Kafka bytes decoded (a re-keying ``key_by`` forwards those bytes instead of encoding the
    value again; key functions must not modify the value)."""
    return bool(node.inputs) and all(
        u.kind == "source" and u.fn.value_format == "json" for u in node.inputs
    )
