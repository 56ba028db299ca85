"""Broker-free testing of a pipeline: run it in-process over lists of input records and get,
per sink, the outputs a worker would have made visible.

The records go through the same task, operators, keyed state backend and checkpoint code as a
worker's (only Kafka is replaced: inputs are lists, and every sink is replaced by a writer that
keeps what would have been published). A crash can be simulated between checkpoints: the task
is thrown away with its uncommitted output, its state is restored from the last checkpoint's
files and the input is read again from that checkpoint's positions. Checkpoints fall at the
same input positions and channels are read in the same order with and without a crash, so a
test can assert that an exactly-once pipeline's output is the same with and without one::

    from snapline.testing import run_pipeline

    result = run_pipeline(pipeline, {"orders": [{"customer": "a", "amount": 3}, ...]},
                          checkpoint_every=100, crash_after=250)
    assert result.outputs["customer-totals"] == expected

What differs from a deployment: one task per stage holds every partition of the stage, and a
repartition topic is a list that the next stage reads once the checkpoint commits; there is
no Kafka transaction (a checkpoint "commits" when its snapshot is durable in a temporary
checkpoint directory). With ``guarantee="at_least_once"`` a worker has no transaction
either: Kafka sink records, dead letters and repartition records are visible (readable) as
produced and stay after a crash, so the records read again produce them again, the
duplicates a worker produces; two-phase-commit sinks (Parquet, PostgreSQL, user sinks) still
publish at the checkpoint's commit.

Sinks check what a worker's would: a ``KafkaSink`` value its format or key function cannot
encode, a ``ParquetSink`` row that does not fit the table's schema (declared, else inferred
from the first rows) or whose partition directory would be too long, is a dead letter. A
``PostgresSink``'s rows are not checked (that needs the table).

Event time works as in a worker: ``Message(timestamp=...)`` (or the source's ``timestamp=``
function) drives the watermarks, which cross repartition topics as watermark records; one
record is read at a time, so a record sees the watermark left by the records before it. At
the end of the input the watermark jumps to the end of time (``end_watermark=True``, like
Flink at the end of a bounded input): every window and event-time timer fires.

Threads: everything runs on the caller's thread.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

from snapline.connectors.kafka_source import KafkaSource
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.formats import encoder
from snapline.pipeline.graph import Node, Pipeline
from snapline.pipeline.record import ListedMessage
from snapline.pipeline.runtime.faults import FaultInjector
from snapline.pipeline.runtime.task import Task, TaskSnapshot
from snapline.pipeline.runtime.timers import processing_time_ms
from snapline.pipeline.runtime.transaction import TransactionalOutput
from snapline.pipeline.runtime.watermarks import MAX_WATERMARK
from snapline.pipeline.sink import Sink
from snapline.pipeline.stages import task_id_for
from snapline.pipeline.state import create_backend
from snapline.pipeline.state.backend import StateHandle
from snapline.testing_capture import (
    _CapturingSink,
    _Output,
    _Produced,
)

__all__ = ["Message", "TestRun", "run_pipeline"]


@dataclass(frozen=True)
class Message:
    """One input record: its value (encoded with the source's ``value_format``), and
    optionally a key (encoded with its ``key_format``; bytes are taken as the raw Kafka key, as
    a bytes value is taken as the raw value), a timestamp (ms) and a partition."""

    value: Any
    key: Any = None
    timestamp: int = 0
    partition: int = 0


@dataclass
class TestRun:
    """What a run produced: per sink (by name, and by topic for Kafka sinks) the values a
    worker would have made visible, in order; the dead letters (value, reason); the late
    records windows dropped (``on_late="drop"``); the checkpoints. Exactly-once, outputs and
    dead letters are those of committed checkpoints, so a crash repeats none of them; at
    least once, a Kafka sink's values and the dead letters of the records a crash makes the
    task read again appear twice, as in a worker. Late drops count committed checkpoints."""

    outputs: dict[str, list[Any]] = field(default_factory=dict)
    dead_letters: list[tuple[Any, str]] = field(default_factory=list)
    late_dropped: int = 0
    checkpoints: int = 0
    crashes: int = 0


#: A record produced to Kafka: topic, value, key, headers, timestamp.


def _never_at_end(tp: tuple[str, int], since: float) -> bool:
    return False


def _sink_names(sink: Sink) -> list[str]:
    topic = getattr(sink, "topic", None)
    return [sink.name] + ([topic] if isinstance(topic, str) and topic != sink.name else [])


def _encode_inputs(
    pipeline: Pipeline, inputs: Mapping[str, Sequence[Any]]
) -> dict[tuple[str, int], list[ListedMessage]]:
    sources: dict[str, KafkaSource] = {t: s for s in pipeline.sources() for t in s.topic_list}
    unknown = sorted(set(inputs) - set(sources))
    if unknown:
        raise ValueError(
            f"inputs for topics {unknown} that no source reads; sources: {sorted(sources)}"
        )
    channels: dict[tuple[str, int], list[ListedMessage]] = {(t, 0): [] for t in sources}
    for topic, items in inputs.items():
        source = sources[topic]
        encode_value, encode_message_key = encoder(source.value_format), encoder(source.key_format)
        for item in items:
            message = item if isinstance(item, Message) else Message(item)
            tp = (topic, message.partition)
            channel = channels.setdefault(tp, [])
            value = _encoded(encode_value, message.value, "value", source.value_format, topic)
            key = _encoded(encode_message_key, message.key, "key", source.key_format, topic)
            channel.append(ListedMessage(topic, tp[1], len(channel), value, key, message.timestamp))
    return channels


def _encoded(
    encode: Callable[[Any], bytes | None], value: Any, what: str, fmt: str, topic: str
) -> bytes | None:
    """An input's value or key as the Kafka bytes its source decodes (bytes: as they are)."""
    if isinstance(value, bytes):
        return value
    try:
        return encode(value)
    except Exception as exc:
        raise ValueError(
            f"the input {what} {value!r} for topic {topic!r} cannot be encoded in the "
            f"source's {what}_format {fmt!r} ({exc}); give a value of that format, or bytes "
            "for the raw Kafka bytes"
        ) from exc


def run_pipeline(
    pipeline: Pipeline,
    inputs: Mapping[str, Sequence[Any]],
    *,
    checkpoint_every: int = 100,
    crash_after: int | Sequence[int] = (),
    end_watermark: bool = True,
    processing_time: Callable[[], int] | None = None,
) -> TestRun:
    """Run ``pipeline`` over ``inputs`` (topic -> values or ``Message``s) in-process.

    A checkpoint is taken and committed after every ``checkpoint_every`` records read (counted
    by input position, repartition topics included, so that after a crash checkpoints fall
    where they did without it) and at the end. ``crash_after``: after that many records read
    (one number or several; records read again after a crash count too), the task crashes —
    output not yet visible is dropped (at least once, Kafka sink records, dead letters and
    repartition records are visible as produced), state is restored from the last committed
    checkpoint and input is re-read from its positions. ``end_watermark``: once the input is
    read, the watermark advances to the end of time, stage by stage (windows fire).
    ``processing_time``: the clock (ms) of processing-time timers and state TTL instead of
    the wall clock; expired state is swept before every checkpoint."""
    pipeline.validate()
    crashes = sorted({crash_after} if isinstance(crash_after, int) else set(crash_after))
    result = TestRun()
    sink_lists: dict[str, list[Any]] = {}
    nodes: list[Node] = []
    by_id: dict[int, Node] = {}
    for node in pipeline.nodes:  # a copy of the graph with every sink replaced
        fn = node.fn
        if node.kind == "sink":
            published: list[Any] = []
            for name in _sink_names(node.fn):
                sink_lists[name] = published
            fn = _CapturingSink(node.fn.name, published, node.fn, pipeline.exactly_once)
        copy = Node(
            node.kind,
            [by_id[i.id] for i in node.inputs],
            fn,
            node.name,
            node.keyed,
            node.id,
            dict(node.options),
        )
        by_id[node.id] = copy
        nodes.append(copy)
    test_pipeline = _clone(pipeline, nodes)
    channels = _encode_inputs(pipeline, inputs)
    with tempfile.TemporaryDirectory(prefix="snapline-testing-") as tmp:
        storage = CheckpointStorage(f"{tmp}/checkpoints")
        runner = _Runner(test_pipeline, channels, storage, tmp, result, processing_time)
        runner.run(checkpoint_every, crashes, end_watermark)
    result.outputs = {name: list(values) for name, values in sink_lists.items()}
    return result


def _clone(pipeline: Pipeline, nodes: list[Node]) -> Pipeline:
    clone = Pipeline.__new__(Pipeline)
    clone.__dict__.update(pipeline.__dict__)
    clone.nodes = nodes
    return clone


@dataclass(frozen=True)
class _Schedule:
    """Where a run is in its reading order: the next channel (an index into the fixed order),
    whether the current round read anything, and the input position (records read from every
    channel) of the next checkpoint. Saved with each committed checkpoint: the run restored
    after a crash reads and checkpoints as the run without the crash did."""

    index: int = 0
    progressed: bool = False
    next_checkpoint: int = 0


class _Runner:
    """Feeds the channels through one task per stage, checkpoints, crashes and restores.

    Rounds over a fixed order of channels (stage by stage), one record from each channel
    with one to read. Repartition topics are lists: exactly-once, a record produced to one
    becomes readable by the next stage's task when its checkpoint commits (as a
    read_committed consumer sees it); at-least-once, at once."""

    def __init__(
        self,
        pipeline: Pipeline,
        channels: dict[tuple[str, int], list[ListedMessage]],
        storage: CheckpointStorage,
        tmp: str,
        result: TestRun,
        processing_time: Callable[[], int] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.processing_time = processing_time or processing_time_ms
        self.plan = pipeline.stages()
        self.channels = dict(channels)
        for rep in self.plan.repartitions.values():
            self.channels[(rep.topic, 0)] = []
        self.repartitioned = {r.topic for r in self.plan.repartitions.values()}
        stage_of = self.plan.stage_of_topics(pipeline.source_topics())
        self.storage = storage
        self.tmp = tmp
        self.result = result
        self.output = _Output(self._publish, transactional=pipeline.exactly_once)
        #: Per stage: the committed checkpoint's id, input positions and state handle.
        self.committed: dict[int, tuple[int, dict[tuple[str, int], int], StateHandle | None]] = {
            stage.index: (
                0,
                {tp: 0 for tp in self.channels if stage_of[tp[0]] == stage.index},
                None,
            )
            for stage in self.plan.stages
        }
        #: Every channel, in the order of reading: by stage, then as the stage's task has them.
        self.order = [
            (stage, tp) for stage, (_, positions, _) in self.committed.items() for tp in positions
        ]
        #: The committed checkpoint's schedule.
        self.schedule = _Schedule()
        #: Per stage: the committed checkpoint's clock (watermarks).
        self.committed_time: dict[int, dict[str, Any] | None] = {}
        self.snapshots: list[TaskSnapshot] = []
        #: Per stage: its task's late drops up to the last committed checkpoint (the drops
        #: after it are in epochs a crash throws away).
        self.late_committed: dict[int, int] = {}
        self.restarts = 0
        self.tasks = self._new_tasks(1)

    def _new_tasks(self, epoch: int) -> dict[int, Task]:
        self.restarts += 1
        tasks = {}
        for stage, (_, positions, handle) in self.committed.items():
            backend = create_backend(
                self.pipeline.state_backend,
                task_dir=f"{self.tmp}/local/{self.restarts}/{stage}",
                options=dict(self.pipeline.state_backend_options),
            )
            if handle is not None:
                backend.restore(handle, self.storage)
            tasks[stage] = Task(
                task_id_for(stage, 0),  # like a worker's: partition 0 of the stage
                self.pipeline,
                dict(positions),
                backend,
                cast(TransactionalOutput, self.output),
                worker_id="testing",
                epoch=epoch,
                on_snapshot=self.snapshots.append,
                faults=FaultInjector(""),
                stage=stage,
                plan=self.plan,
                topic_partitions={r.topic: 1 for r in self.plan.repartitions.values()},
                time_state=self.committed_time.get(stage),
                clock=self.processing_time,
                ttl_sweep_interval=0.0,
                # A partition is never idle here (a worker asks Kafka; the wall clock of a
                # test run must not change its results): the end of the input ends time.
                source_ends=_never_at_end,
            )
        return tasks

    def _positions(self) -> dict[tuple[str, int], int]:
        return {tp: o for _, positions, _ in self.committed.values() for tp, o in positions.items()}

    def run(self, checkpoint_every: int, crashes: list[int], end_watermark: bool) -> None:
        reads = 0  # every record read, again after a crash too (crash_after counts them)
        total = sum(len(c) for c in self.channels.values())
        positions = self._positions()
        position = sum(positions.values())
        self.schedule = _Schedule(next_checkpoint=checkpoint_every)
        index, progressed, next_checkpoint = 0, False, checkpoint_every
        while True:
            if index == len(self.order):  # the end of a round
                index = 0
                if progressed:
                    progressed = False
                    continue
                here = _Schedule(0, False, next_checkpoint)
                if self.output.by_epoch:  # uncommitted repartition records: commit them
                    self._checkpoint(here)
                    if any(positions[tp] < len(m) for tp, m in self.channels.items()):
                        continue
                ending = [t for _, t in sorted(self.tasks.items()) if t.watermark < MAX_WATERMARK]
                if end_watermark and ending:
                    # The lowest stage first: its watermark records carry the end of time to
                    # the next stage, which reads them after this checkpoint commits.
                    ending[0].end_of_input()
                    self._checkpoint(here)
                    continue
                break
            stage, tp = self.order[index]
            index += 1
            messages = self.channels[tp]
            offset = positions[tp]
            if offset >= len(messages):
                continue
            task = self.tasks[stage]
            task.enqueue(tp, [messages[offset]])
            positions[tp] = offset + 1
            position += 1
            reads += 1
            progressed = True
            task.run()
            if crashes and reads >= crashes[0]:
                crashes.pop(0)
                positions = self._crash()
                position = sum(positions.values())
                index, progressed, next_checkpoint = (
                    self.schedule.index,
                    self.schedule.progressed,
                    self.schedule.next_checkpoint,
                )
            elif position >= next_checkpoint:
                next_checkpoint = position + checkpoint_every
                self._checkpoint(_Schedule(index, progressed, next_checkpoint))
            if reads > 10 * (total + sum(len(c) for c in self.channels.values())) + 1000:
                raise RuntimeError("the test run does not progress; check crash_after")
        self._checkpoint(_Schedule(0, False, next_checkpoint))
        for task in self.tasks.values():
            task.close()

    def _checkpoint(self, schedule: _Schedule) -> None:
        """Checkpoint every task and commit; ``schedule``: where the run goes on from."""
        tasks = self.tasks
        n = max(task.epoch for task in tasks.values())  # the barrier closes the open epoch
        for task in tasks.values():
            task.epoch = n
            task.inject_barrier(n)
            task.run()
        snapshots = {snap.task_id: snap for snap in self.snapshots}
        self.snapshots.clear()
        handles = {}
        for stage, task in tasks.items():
            snapshot = snapshots[task.task_id]
            handle = None
            if snapshot.state is not None:
                try:
                    handle = snapshot.state.materialize(self.storage, f"test/s{stage}/chk-{n:010d}")
                finally:
                    snapshot.state.release()
            for result in snapshot.sinks.values():
                if isinstance(result, Future):
                    result.result()
            handles[stage] = (n, dict(snapshot.positions), handle)
            self.committed_time[stage] = snapshot.time
        # The commit point: every snapshot is durable; the output becomes visible.
        self.committed = handles
        self.schedule = schedule
        for stage, task in tasks.items():
            task.notify_committed(n)
            dropped = task.late_dropped
            self.result.late_dropped += dropped - self.late_committed.get(stage, 0)
            self.late_committed[stage] = dropped
        for record in self.output.take_committed(n):
            self._publish(record)
        self.result.checkpoints += 1

    def _publish(self, record: _Produced) -> None:
        """A produced record becomes visible: a repartition topic's joins its channel, a dead
        letter the run's dead letters."""
        topic, value, key, headers, timestamp = record
        if topic in self.repartitioned:
            channel = self.channels[(topic, 0)]
            channel.append(ListedMessage(topic, 0, len(channel), value, key, timestamp))
            return
        reason = dict(headers or {}).get("snapline.error", b"").decode()
        self.result.dead_letters.append((value, reason))

    def _crash(self) -> dict[tuple[str, int], int]:
        """Drop the tasks and everything uncommitted; restore the last checkpoint. What is
        published stays (at least once: the Kafka records produced since the checkpoint)."""
        self.result.crashes += 1
        epoch = max(task.epoch for task in self.tasks.values()) + 1
        for task in self.tasks.values():
            task.close()
        self.output.by_epoch.clear()
        self.snapshots.clear()
        self.late_committed.clear()  # the new tasks count from 0
        self.tasks = self._new_tasks(epoch)
        return self._positions()
