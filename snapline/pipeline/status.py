"""A job's status from Kafka and checkpoint storage alone (no worker needs to run): per task
its partitions' committed offsets, end offsets and lag, and its last checkpoint.

Used by ``snapline status`` and ``snapline ui``. Threads: the caller's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from snapline.pipeline.checkpoint.metadata import (
    CheckpointRef,
    TaskCheckpoint,
    is_marked_committed,
    list_checkpoints,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import SnaplineError
from snapline.pipeline.graph import Pipeline
from snapline.pipeline.stages import task_id_for

log = logging.getLogger(__name__)

#: Partitions less than this many offsets behind have their lag counted by reading the
#: records (read_committed): offsets of transactional topics (repartition topics, input
#: written in transactions) include commit markers, which are not records to process.
COUNT_LAG_BELOW = 1000
#: Seconds spent at most counting those records.
COUNT_LAG_SECONDS = 3.0


@dataclass(frozen=True)
class PartitionStatus:
    topic: str
    partition: int
    #: The group's committed offset (-1: none yet).
    committed: int
    #: The partition's end offset (high watermark; -1: unknown).
    end: int
    #: The checkpoint the committed offset names (None: none).
    checkpoint: CheckpointRef | None
    #: Records after the committed offset, counted by reading them (None: not counted).
    counted: int | None = None

    @property
    def lag(self) -> int | None:
        """Records after the committed offset (None when either offset is unknown).

        Counted where they were read (a few behind: see ``COUNT_LAG_BELOW``); otherwise the
        end offset minus the committed one, which also counts transaction markers."""
        if self.counted is not None:
            return self.counted
        if self.end < 0:
            return None
        return max(0, self.end - max(self.committed, 0))


@dataclass(frozen=True)
class CheckpointSummary:
    """A task's checkpoint as storage holds it."""

    ref: CheckpointRef
    committed: bool
    complete: bool
    bytes: int = 0
    created_at: float = 0.0
    worker: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class TaskStatus:
    task_id: str
    stage: int
    partitions: tuple[PartitionStatus, ...]
    #: Stored checkpoints, oldest first.
    checkpoints: tuple[CheckpointSummary, ...]

    @property
    def last_checkpoint(self) -> CheckpointSummary | None:
        """The newest checkpoint known committed (by its marker or the committed offsets)."""
        named = {p.checkpoint for p in self.partitions if p.checkpoint is not None}
        for summary in reversed(self.checkpoints):
            if summary.committed or summary.ref in named:
                return summary
        return None

    @property
    def lag(self) -> int | None:
        lags = [p.lag for p in self.partitions]
        return None if any(x is None for x in lags) else sum(x for x in lags if x is not None)


def stored_checkpoints(
    storage: CheckpointStorage, job: str, task_id: str
) -> tuple[CheckpointSummary, ...]:
    """Every checkpoint directory of a task with what its metadata says (incomplete ones with
    the reason)."""
    found = []
    for ref in list_checkpoints(storage, job, task_id):
        committed = is_marked_committed(storage, job, task_id, ref)
        try:
            meta = TaskCheckpoint.read(storage, job, task_id, ref)
        except SnaplineError as exc:
            found.append(CheckpointSummary(ref, committed, False, error=str(exc)))
            continue
        size = sum(f.size for f in meta.state.files) if meta.state else 0
        found.append(
            CheckpointSummary(
                ref, committed, True, size, meta.created_at, meta.worker_id, dict(meta.timings)
            )
        )
    return tuple(found)


def stored_task_ids(storage: CheckpointStorage, job: str) -> list[str]:
    """Tasks with a directory in checkpoint storage."""
    return storage.list_dir(f"{job}/tasks")


def job_status(
    pipeline: Pipeline, kafka_config: dict[str, Any] | None, storage: CheckpointStorage
) -> list[TaskStatus]:
    """Every task of the job: from Kafka (when ``kafka_config`` is given) the partitions,
    committed offsets and end offsets; from storage the checkpoints. Without Kafka, the tasks
    that storage knows."""
    partitions: dict[str, list[PartitionStatus]] = {}
    stages: dict[str, int] = {}
    if kafka_config is not None:
        from snapline.pipeline.savepoint.markers import use_topic_generations

        use_topic_generations(pipeline, storage)  # the repartition topics it uses now
        for stage, status in _kafka_partitions(pipeline, kafka_config):
            task_id = task_id_for(stage, status.partition)
            partitions.setdefault(task_id, []).append(status)
            stages[task_id] = stage
    for task_id in stored_task_ids(storage, pipeline.name):
        partitions.setdefault(task_id, [])
    result = []
    for task_id in sorted(partitions, key=_task_order):
        result.append(
            TaskStatus(
                task_id,
                stages.get(task_id, _stage_number(task_id)),
                tuple(sorted(partitions[task_id], key=lambda p: (p.topic, p.partition))),
                stored_checkpoints(storage, pipeline.name, task_id),
            )
        )
    return result


def _stage_number(task_id: str) -> int:
    head, sep, _ = task_id.partition("-")
    return int(head[1:]) if sep and head[1:].isdigit() else 0


def _task_order(task_id: str) -> tuple[int, int]:
    tail = task_id.rsplit("-", 1)[-1]
    return (_stage_number(task_id), int(tail[1:]) if tail[1:].isdigit() else 0)


def _kafka_partitions(
    pipeline: Pipeline, kafka_config: dict[str, Any]
) -> list[tuple[int, PartitionStatus]]:
    """(stage, partition status) for every input partition of the job."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    plan = pipeline.stages()
    source_topics = pipeline.source_topics()
    stage_of = plan.stage_of_topics(source_topics)
    topics = plan.input_topics(source_topics)
    # Not subscribed: reading committed offsets does not join (or disturb) the group.
    consumer = Consumer(
        {
            **kafka_config,
            "group.id": pipeline.name,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        metadata = consumer.list_topics(timeout=15)
        tps = []
        for topic in topics:
            info = metadata.topics.get(topic)
            if info is None or info.error is not None:
                log.warning("topic %s is missing: its tasks are not shown", topic)
                continue
            tps += [TopicPartition(topic, p) for p in sorted(info.partitions)]
        committed = consumer.committed(tps, timeout=15) if tps else []
        result = []
        for c in committed:
            try:
                _low, high = consumer.get_watermark_offsets(
                    TopicPartition(c.topic, c.partition), timeout=10
                )
            except KafkaException:
                high = -1
            try:
                ref = CheckpointRef.parse_offset_metadata(c.metadata)
            except SnaplineError:
                ref = None
            status = PartitionStatus(c.topic, c.partition, c.offset, high, ref)
            result.append((stage_of[c.topic], status))
        counted = _count_records(
            consumer,
            [
                s
                for _, s in result
                if s.committed >= 0 and 0 < s.end - s.committed < COUNT_LAG_BELOW
            ],
        )
        return [
            (stage, replace(s, counted=counted.get((s.topic, s.partition)))) for stage, s in result
        ]
    finally:
        consumer.close()


def _count_records(consumer: Any, behind: list[PartitionStatus]) -> dict[tuple[str, int], int]:
    """The committed records after each partition's committed offset, for the partitions
    whose reading reached their end offset within COUNT_LAG_SECONDS (assigned, not
    subscribed: the group is not joined and nothing is committed)."""
    from confluent_kafka import TopicPartition

    if not behind:
        return {}
    ends = {(s.topic, s.partition): s.end for s in behind}
    counts = dict.fromkeys(ends, 0)
    pending = set(ends)
    consumer.assign([TopicPartition(s.topic, s.partition, s.committed) for s in behind])
    deadline = time.monotonic() + COUNT_LAG_SECONDS
    try:
        while pending and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.2):
                key = (msg.topic(), msg.partition())
                if msg.error() is None and key in pending and msg.offset() < ends[key]:
                    counts[key] += 1
            for tp in consumer.position([TopicPartition(t, p) for t, p in pending]):
                if tp.offset >= ends[(tp.topic, tp.partition)]:
                    pending.discard((tp.topic, tp.partition))
    finally:
        consumer.unassign()
    return {key: n for key, n in counts.items() if key not in pending}
