"""Writing a savepoint from a job's committed checkpoints (``snapline savepoint create`` once
the workers have committed and paused, ``snapline savepoint from-checkpoint`` while the job is
down): the checkpoint each task's committed offsets name is restored into a scratch backend,
its entries are written per operator as Parquet, and the records in flight in repartition
topics are copied, so the savepoint refers to nothing else.

Threads: the caller's (a CLI process, never a worker); ``export_task`` runs in threads of it
or in pool processes (``pool``), one job per thread with a scratch backend of its own.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec

from snapline.pipeline.checkpoint.metadata import METADATA_FILE as CHECKPOINT_METADATA
from snapline.pipeline.checkpoint.metadata import (
    CheckpointRef,
    TaskCheckpoint,
    highest_checkpoint_id,
    is_marked_committed,
    list_checkpoints,
)
from snapline.pipeline.checkpoint.restore import restore_committed
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, ConfigurationError
from snapline.pipeline.graph import Pipeline
from snapline.pipeline.keygroups import key_group_range
from snapline.pipeline.runtime import departed
from snapline.pipeline.runtime.kafka_calls import raise_partition_errors
from snapline.pipeline.runtime.sink_recovery import publish_staged
from snapline.pipeline.runtime.topics import cluster_id_of, ids_differ
from snapline.pipeline.runtime.transaction import transaction_timeout
from snapline.pipeline.runtime.watermarks import WATERMARK_KEY_TAG
from snapline.pipeline.savepoint.format import (
    ENTRY_SCHEMA,
    IN_FLIGHT_SCHEMA,
    METADATA_FILE,
    ROW_GROUP_ROWS,
    InFlight,
    OperatorState,
    SavepointFile,
    SavepointMetadata,
    TableWriter,
    write_table,
)
from snapline.pipeline.savepoint.pool import pool_size, run_jobs, scratch_options
from snapline.pipeline.stages import SOURCE_STAGE, StagePlan, task_id_for
from snapline.pipeline.state import create_backend
from snapline.pipeline.state.columns import StoredKeys, split_stored_keys
from snapline.pipeline.state.compat import state_description

log = logging.getLogger(__name__)

SNAPLINE_VERSION = "0.1.0"
#: How long reading a repartition topic's records in flight may take.
IN_FLIGHT_TIMEOUT = 120.0

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class JobTask:
    task_id: str
    stage: int
    partition: int
    inputs: tuple[tuple[str, int], ...]


def job_tasks(pipeline: Pipeline, partitions: dict[str, int]) -> list[JobTask]:
    """Every task of the job: (stage, partition) with its input partitions."""
    plan = pipeline.stages()
    stage_of = plan.stage_of_topics(pipeline.source_topics())
    inputs: dict[tuple[int, int], list[tuple[str, int]]] = defaultdict(list)
    for topic in plan.input_topics(pipeline.source_topics()):
        for p in range(partitions[topic]):
            inputs[(stage_of[topic], p)].append((topic, p))
    return [
        JobTask(task_id_for(stage, p), stage, p, tuple(tps))
        for (stage, p), tps in sorted(inputs.items())
    ]


def topic_partitions(admin: AdminClient, topics: list[str], where: str) -> dict[str, int]:
    try:
        metadata = admin.list_topics(timeout=30)
    except KafkaException as exc:
        raise CheckpointError(f"cannot reach Kafka at {where}: {exc}") from exc
    missing = [t for t in topics if t not in metadata.topics]
    if missing:
        raise ConfigurationError(f"topics {missing} do not exist on {where}")
    return {t: len(metadata.topics[t].partitions) for t in topics}


def active_members(admin: AdminClient, group: str) -> int:
    """Members of the job's consumer group right now (0: the job is not running). Described,
    not asked of ListGroups first (``listed_groups``, the guard against librdkafka #4605): a
    group that moves between coordinators can be missing from ListGroups' answer, or listed
    empty by its old one, and a restore that took a running job for stopped would recreate
    its repartition topics under it. A describe looks the coordinator up and retries."""
    future = admin.describe_consumer_groups([group], request_timeout=30)[group]
    return len(future.result(timeout=35).members)


def wait_until_stopped(admin: AdminClient, group: str, timeout: float = 30.0) -> int:
    """Members left in the group after up to ``timeout`` s. Workers are static members: one
    that stopped stays listed until its session times out (10 s by default)."""
    deadline = time.monotonic() + timeout
    members = active_members(admin, group)
    while members and time.monotonic() < deadline:
        time.sleep(1.0)
        members = active_members(admin, group)
    return members


def committed_offsets(
    kafka_config: dict[str, Any], group: str, tps: list[tuple[str, int]]
) -> dict[tuple[str, int], TopicPartition]:
    consumer = Consumer({**kafka_config, "group.id": group, "enable.auto.commit": False})
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                got = consumer.committed([TopicPartition(t, p) for t, p in tps], timeout=20)
                raise_partition_errors(got, "committed offsets")  # not "nothing committed"
                return {(c.topic, c.partition): c for c in got}
            except KafkaException as exc:  # pending transactional offsets, a busy coordinator
                if time.monotonic() > deadline:
                    raise CheckpointError(f"cannot read the committed offsets: {exc}") from exc
                time.sleep(1.0)
    finally:
        consumer.close()


def _check_unmoved(
    kafka_config: dict[str, Any], group: str, before: dict[tuple[str, int], TopicPartition]
) -> None:
    """Raise if the job's committed offsets are not ``before`` any more."""
    now = committed_offsets(kafka_config, group, list(before))
    moved = sorted(
        f"{t}[{p}] {before[(t, p)].offset} -> {now[(t, p)].offset}"
        for t, p in before
        if (t, p) in now
        # The metadata names the checkpoint: a commit of one that read nothing moves it alone.
        and (now[(t, p)].offset, now[(t, p)].metadata)
        != (before[(t, p)].offset, before[(t, p)].metadata)
    )
    if moved:
        raise CheckpointError(
            f"the job {group!r} committed new checkpoints while its savepoint was taken "
            f"({', '.join(moved[:5])}{' ...' if len(moved) > 5 else ''}): a worker started "
            "meanwhile (it never saw the request), or one did not hear the CLI for the pause "
            "limit and resumed, so the records in flight no longer match the state. The "
            "savepoint was not completed; take it again with no worker starting meanwhile, or "
            "stop the job and use `snapline savepoint from-checkpoint`"
        )


def named_checkpoint(task: JobTask, committed: list[TopicPartition]) -> CheckpointRef | None:
    refs = {CheckpointRef.parse_offset_metadata(c.metadata) for c in committed if c.offset >= 0}
    if len(refs) > 1:
        raise CheckpointError(f"partitions of task {task.task_id} name different checkpoints")
    return refs.pop() if refs else None


def _texts(values: pa.Array) -> pa.Array:
    """The values as UTF-8 text where they decode (None elsewhere), vectorized when all do."""
    try:
        return pa.compute.cast(values, pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        out = []
        for raw in values.to_pylist():
            try:
                out.append(None if raw is None else raw.decode())
            except UnicodeDecodeError:
                out.append(None)
        return pa.array(out, type=pa.string())


def _states_by_id(pipeline: Pipeline, meta: TaskCheckpoint) -> dict[int, tuple[str, str, bool]]:
    """State id -> (operator uid, state name, JSON serde) as the checkpoint recorded them."""
    uids = pipeline.operator_uids()
    by_sid: dict[int, tuple[str, str, bool]] = {}
    for desc in meta.states:
        uid = desc.get("uid") or uids.get(int(desc["operator"]))
        if uid is None:
            raise CheckpointError(
                f"checkpoint {meta.checkpoint_id} of task {meta.task_id} holds state "
                f"{desc['name']!r} of an operator this pipeline no longer has"
            )
        by_sid[int(desc["id"])] = (uid, desc["name"], desc.get("serde") == "json")
    return by_sid


def export_task_state(
    pipeline: Pipeline, meta: TaskCheckpoint, backend: Any
) -> dict[str, pa.Table]:
    """The task's entries as one table per operator uid (state ids as its checkpoint recorded
    them), in ``ENTRY_SCHEMA``, rows in key-group order (readers of a key-group range skip
    the other row groups). Whole columns at a time: a savepoint of 1M keys is Arrow work."""
    stored, values = backend.export_arrays()
    return _entry_tables(_states_by_id(pipeline, meta), meta, stored, values)


def export_task_batches(
    pipeline: Pipeline, meta: TaskCheckpoint, backend: Any
) -> Iterator[dict[str, pa.Table]]:
    """``export_task_state`` a batch of about ``ROW_GROUP_ROWS`` entries at a time when the
    backend exports in key order (rocksdb: writing a batch, GIL released, overlaps another
    thread's iterating); all at once otherwise (the rows must be sorted as a whole)."""
    by_sid = _states_by_id(pipeline, meta)
    if not backend.exports_in_key_order:
        yield _entry_tables(by_sid, meta, *backend.export_arrays())
        return
    last_group = -1
    for stored, values in backend.export_batches(ROW_GROUP_ROWS):
        if not len(stored):
            continue
        # A stored key starts with its key-group (2 bytes, big-endian); within a batch the
        # order is checked by _entry_tables.
        if int.from_bytes(stored[0].as_py()[:2], "big") < last_group:
            raise CheckpointError(
                f"the {backend.name} backend exported checkpoint {meta.checkpoint_id} of task "
                f"{meta.task_id} out of key-group order"
            )
        last_group = int.from_bytes(stored[-1].as_py()[:2], "big")
        yield _entry_tables(by_sid, meta, stored, values, sort=False)


def _entry_tables(
    by_sid: dict[int, tuple[str, str, bool]],
    meta: TaskCheckpoint,
    stored: pa.Array,
    values: pa.Array,
    *,
    sort: bool = True,
) -> dict[str, pa.Table]:
    """Stored keys and values as one ``ENTRY_SCHEMA`` table per operator uid; ``sort``: into
    key-group order (unless they are), else they must be (checked within the batch)."""
    if values.type != pa.binary():
        values = values.cast(pa.binary())
    if not len(stored):
        return {}
    parts = split_stored_keys(stored)
    groups = parts.key_group.to_numpy()
    if len(groups) > 1 and not bool((groups[1:] >= groups[:-1]).all()):
        if not sort:
            raise CheckpointError(
                f"checkpoint {meta.checkpoint_id} of task {meta.task_id} was exported out of "
                "key-group order"
            )
        order = np.argsort(groups, kind="stable")
        take = pa.array(order)
        parts = StoredKeys(
            parts.key_group.take(take),
            parts.key.take(take),
            parts.state_id[order],
            parts.map_key.take(take),
        )
        values = values.take(take)
    sids = parts.state_id
    unknown = set(np.unique(sids).tolist()) - set(by_sid)
    if unknown:
        raise CheckpointError(
            f"checkpoint {meta.checkpoint_id} of task {meta.task_id} has entries of state ids "
            f"{sorted(unknown)}, which its metadata does not describe"
        )
    sid_index = pa.array(sids.astype(np.int32))
    names = pa.array([by_sid[i][1] if i in by_sid else None for i in range(256)], pa.string())
    is_json = np.array([i in by_sid and by_sid[i][2] for i in range(256)])
    json_rows = is_json[sids]
    if json_rows.all():
        json_values = values
    else:
        json_values = pa.compute.if_else(pa.array(json_rows), values, pa.scalar(None, pa.binary()))
    table = pa.table(
        {
            "key_group": parts.key_group,
            "key": parts.key,
            "key_text": _texts(parts.key),
            "state": names.take(sid_index),
            "map_key": parts.map_key,
            "map_key_text": _texts(parts.map_key),
            "value": values,
            "value_json": _texts(json_values),
        },
        schema=ENTRY_SCHEMA,
    )
    operators = {by_sid[sid][0] for sid in np.unique(sids).tolist()}
    if len(operators) == 1:
        return {operators.pop(): table}
    uid_names = pa.array([by_sid[i][0] if i in by_sid else None for i in range(256)])
    uid_column = uid_names.take(sid_index)
    return {uid: table.filter(pa.compute.equal(uid_column, uid)) for uid in operators}


def job_transaction_timeout(pipeline: Pipeline) -> float:
    """The ``transaction.timeout.ms`` of the job's workers, in seconds: the setting, else what
    its checkpoints need (``transaction_timeout``: at least 60 s, the interval plus
    ``checkpoint_timeout`` plus 10 s)."""
    config = dict(pipeline.kafka_config)
    if pipeline.exactly_once:
        try:
            return (
                transaction_timeout(
                    config, pipeline.checkpoint_interval, pipeline.checkpoint_timeout
                )
                / 1000
            )
        except ConfigurationError:
            pass  # the workers refuse to start with it: as the setting says, else the default
    return float(config.get("transaction.timeout.ms", 60000)) / 1000


def read_in_flight(
    kafka_config: dict[str, Any],
    topic: str,
    starts: dict[int, int],
    timeout: float | None = None,
) -> pa.Table:
    """Committed records of ``topic`` from ``starts`` (partition -> offset) to its end.

    The end is the high watermark, not the last stable offset a read_committed reader is told:
    a transaction left open (a worker killed in its epoch) hides the records other tasks
    committed behind it until it is aborted, at the latest ``transaction.timeout.ms`` after
    it began. Each partition is finished when the consumer's position (past transaction
    markers and aborted records) reaches its end; one not finished within
    ``timeout`` (at least ``IN_FLIGHT_TIMEOUT``, longer than the job's transactions: a
    transaction left open ends by then) is an error, never a savepoint that silently lacks
    records."""
    if not starts:
        return IN_FLIGHT_SCHEMA.empty_table()
    admin = AdminClient(kafka_config)
    try:
        found = admin.list_offsets(
            {TopicPartition(topic, p): OffsetSpec.latest() for p in starts},
            isolation_level=IsolationLevel.READ_UNCOMMITTED,
            request_timeout=30,
        )
        ends = {tp.partition: f.result(timeout=35).offset for tp, f in found.items()}
        found = admin.list_offsets(
            {TopicPartition(topic, p): OffsetSpec.earliest() for p in starts},
            request_timeout=30,
        )
        lows = {tp.partition: f.result(timeout=35).offset for tp, f in found.items()}
    except (KafkaException, FutureTimeout) as exc:
        raise CheckpointError(f"cannot read the end offsets of {topic}: {exc}") from exc
    gone = {p: (starts[p], lows[p]) for p in starts if lows[p] > starts[p] < ends[p]}
    if gone:
        raise CheckpointError(_deleted_in_flight(topic, gone))
    past = {p: (starts[p], ends[p]) for p in starts if starts[p] > ends[p]}
    if past:
        raise CheckpointError(
            f"the job's positions in {topic} are past its end ("
            + ", ".join(f"partition {p}: at {s}, the end is {e}" for p, (s, e) in past.items())
            + "): the topic was deleted and created again since they were committed, and the "
            "records in flight there are gone. Restore a savepoint taken before"
        )
    consumer = Consumer(
        {
            **kafka_config,
            "group.id": f"snapline-savepoint-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            # Never a silent jump past records deleted meanwhile: an error (below).
            "auto.offset.reset": "error",
        }
    )
    columns: dict[str, list[Any]] = {name: [] for name in IN_FLIGHT_SCHEMA.names}
    try:
        todo = {p for p in starts if starts[p] < ends[p]}
        if todo:
            consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(todo)])
        if timeout is None:
            timeout = IN_FLIGHT_TIMEOUT
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                positions = consumer.position([TopicPartition(topic, p) for p in sorted(todo)])
                where = {
                    p.partition: f"at {max(p.offset, starts[p.partition])} of {ends[p.partition]}"
                    for p in positions
                }
                raise CheckpointError(
                    f"reading the records in flight in {topic} took over "
                    f"{timeout:.0f}s; partitions not finished: {where}. A "
                    "transaction left open (a worker killed in its epoch) holds readers back "
                    "until it is aborted (transaction.timeout.ms after it began, or when that "
                    "worker starts again); try again after that"
                )
            batch = consumer.consume(5000, 0.5)
            for msg in batch:
                error = msg.error()
                if error is not None:
                    if error.code() in (
                        KafkaError._AUTO_OFFSET_RESET,
                        KafkaError.OFFSET_OUT_OF_RANGE,
                    ):
                        p = msg.partition()
                        raise CheckpointError(
                            _deleted_in_flight(topic, {p: (starts.get(p, -1), -1)}, str(error))
                        )
                    continue
                p = msg.partition()
                if (msg.key() or b"")[:1] == WATERMARK_KEY_TAG:
                    continue  # upstream watermarks: control, resent by upstream after a restore
                columns["partition"].append(p)
                columns["offset"].append(msg.offset())
                columns["key"].append(msg.key())
                columns["value"].append(msg.value())
                columns["timestamp"].append(msg.timestamp()[1])
                headers = msg.headers()
                columns["headers"].append(
                    [{"name": name, "value": value} for name, value in headers] if headers else None
                )
            for tp in consumer.position([TopicPartition(topic, p) for p in sorted(todo)]):
                if tp.offset >= ends[tp.partition]:
                    todo.discard(tp.partition)
    finally:
        consumer.close()
    return pa.table(columns, schema=IN_FLIGHT_SCHEMA)


def _deleted_in_flight(topic: str, gone: dict[int, tuple[int, int]], detail: str = "") -> str:
    """The error of records in flight that Kafka no longer has ({partition: (from, now from)})."""
    where = ", ".join(
        f"partition {p}: from {start}" + (f", the log now starts at {low}" if low >= 0 else "")
        for p, (start, low) in sorted(gone.items())
    )
    return (
        f"records in flight in {topic} that the savepoint needs were deleted ({where}"
        + (f"; {detail}" if detail else "")
        + "): the job moved on while the savepoint was taken (a worker started meanwhile, or "
        "one did not hear the CLI for the pause limit and resumed), and its workers delete "
        "what they no longer need. Take the savepoint again with no worker starting "
        "meanwhile, or stop the job and use `snapline savepoint from-checkpoint`"
    )


def _state_progress(files: dict[str, list[SavepointFile]]) -> str:
    """The progress step of state export, with the rows and bytes written so far."""
    rows = sum(f.rows for entries in files.values() for f in entries)
    size = sum(f.size for entries in files.values() for f in entries)
    return f"state ({rows:,} rows, {size / 1e6:.1f} MB)"


def default_savepoint_uri(checkpoint_dir: str, job: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return f"{checkpoint_dir.rstrip('/')}/{job}/savepoints/sp-{stamp}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class ExportJob:
    """One task's part of a savepoint, for ``export_task`` in any process."""

    job: str
    task_id: str
    ref: CheckpointRef
    checkpoint_dir: str
    target: str
    #: A local directory of its own for the scratch backend.
    scratch: str
    backend: str
    backend_options: dict[str, Any]
    operator_uids: dict[int, str]
    partition: int
    #: The number of tasks of the task's keyed stage now (its topic's partitions); None in
    #: the source stage.
    stage_tasks: int | None
    max_parallelism: int

    def key_groups(self, meta: TaskCheckpoint) -> tuple[int, int] | None:
        """The task's inclusive key-group range in a keyed stage (None in the source stage),
        by the number of tasks its checkpoint was taken with: partitions added by hand to a
        repartition topic since (the worker refuses to run on, and names a savepoint as the
        fix) would label the state of task p with the key-groups task p owns at the new
        count, and a restore would load each key-group's state into the wrong task."""
        if self.stage_tasks is None:
            return None
        count = meta.task_count if meta.task_count is not None else self.stage_tasks
        if count > self.max_parallelism:
            raise ConfigurationError(
                f"task {self.task_id}: its stage has {count} tasks, more than max_parallelism="
                f"{self.max_parallelism} (a repartition topic created with more partitions than "
                "key-groups): tasks own whole key-groups, so its state cannot be exported. "
                "Declare key_by(partitions=N) with N <= max_parallelism, or raise "
                "max_parallelism, in a job under a new name"
            )
        groups = key_group_range(self.partition, count, self.max_parallelism)
        return groups.start, groups.stop - 1

    def file_name(self, uid: str, key_groups: tuple[int, int] | None) -> str:
        if key_groups is None:
            return f"operators/{uid}/p{self.partition:05d}.parquet"
        return f"operators/{uid}/kg-{key_groups[0]:05d}-{key_groups[1]:05d}.parquet"


@dataclass(frozen=True)
class ExportedTask:
    """What ``export_task`` did: the checkpoint it restored and a file per operator uid."""

    meta: TaskCheckpoint
    files: dict[str, SavepointFile]


@dataclass(frozen=True)
class _Uids:
    """The slice of a Pipeline ``export_task_state`` reads (a pipeline is not picklable)."""

    uids: dict[int, str]

    def operator_uids(self) -> dict[int, str]:
        return self.uids


def export_task(job: ExportJob) -> ExportedTask:
    """Restore the task's committed checkpoint into a scratch backend and write its entries
    as one Parquet file per operator (a module-level function: pool processes run it)."""
    backend = create_backend(
        job.backend, task_dir=job.scratch, options=scratch_options(job.backend, job.backend_options)
    )
    try:
        meta = restore_committed(
            CheckpointStorage(job.checkpoint_dir),
            job.job,
            job.task_id,
            job.ref,
            backend,
            on_corrupt="fail",
        )
        key_groups = job.key_groups(meta)
        writers: dict[str, TableWriter] = {}
        pipeline = _Uids(job.operator_uids)
        for by_uid in export_task_batches(pipeline, meta, backend):  # type: ignore[arg-type]
            for uid, rows in by_uid.items():
                if uid not in writers:
                    writers[uid] = TableWriter(ENTRY_SCHEMA)
                writers[uid].write(rows)
    finally:
        backend.close()
        shutil.rmtree(job.scratch, ignore_errors=True)
    out = CheckpointStorage(job.target)
    info: dict[str, Any] = {"partition": job.partition}
    if key_groups is not None:
        info["key_groups"] = key_groups
    return ExportedTask(
        meta,
        {uid: w.finish(out, job.file_name(uid, key_groups), **info) for uid, w in writers.items()},
    )


def _state_bytes(storage: CheckpointStorage, job: str, task_id: str, ref: CheckpointRef) -> int:
    """The size of a task's checkpointed state (0 when its metadata cannot be read here:
    ``export_task`` reports that)."""
    try:
        meta = TaskCheckpoint.read(storage, job, task_id, ref)
    except CheckpointError:
        return 0
    return sum(f.size for f in meta.state.files) if meta.state is not None else 0


def export_savepoint(
    pipeline: Pipeline,
    kafka_config: dict[str, Any],
    checkpoint_dir: str,
    target: str,
    *,
    origin: str,
    cluster_id: str = "",
    progress: Progress | None = None,
    publish_staged: bool = False,
) -> SavepointMetadata:
    """Write the savepoint of the job's committed checkpoints to ``target`` (see module).
    ``publish_staged`` (the job is stopped): first publish what committed checkpoints left
    staged in Parquet and PostgreSQL sinks (``publish_committed_sinks``)."""
    where = str(kafka_config.get("bootstrap.servers"))
    from snapline.pipeline.savepoint.markers import (
        check_no_interrupted_restore,
        use_topic_generations,
    )

    # After a restore that died half-done, the group's offsets name positions in repartition
    # topics that were recreated since: the records in flight read there would be others.
    check_no_interrupted_restore(CheckpointStorage(checkpoint_dir), pipeline.name)
    use_topic_generations(pipeline, CheckpointStorage(checkpoint_dir))
    plan: StagePlan = pipeline.stages()
    admin = AdminClient(kafka_config)
    inputs = plan.input_topics(pipeline.source_topics())
    partitions = topic_partitions(admin, inputs, where)
    tasks = job_tasks(pipeline, partitions)
    committed = committed_offsets(
        kafka_config, pipeline.name, [tp for t in tasks for tp in t.inputs]
    )
    # Topic ids are per cluster: a restore compares them only on the cluster they are of.
    cluster_id = cluster_id or cluster_id_of(admin)
    storage = CheckpointStorage(checkpoint_dir)
    out = CheckpointStorage(target)
    if out.exists(METADATA_FILE):
        raise ConfigurationError(f"{target} already holds a savepoint; choose another --path")
    if publish_staged:
        publish_committed_sinks(pipeline, storage, admin)
    highest = highest_checkpoint_id(storage, pipeline.name)
    stage_partitions = {
        stage.index: partitions[stage.reads[0]] if stage.reads else None for stage in plan.stages
    }
    files: dict[str, list[SavepointFile]] = defaultdict(list)
    partitioning: dict[str, str] = {}
    states: dict[str, list[dict[str, Any]]] = {}
    positions: dict[tuple[str, int], int] = {}
    clocks: dict[str, dict[str, Any]] = {}
    sources = set(pipeline.source_topics())
    topic_ids: dict[str, str] = {}
    scratch = tempfile.mkdtemp(prefix="snapline-savepoint-")
    try:
        jobs: list[ExportJob] = []
        state_bytes = 0
        for task in tasks:
            tp_committed = [committed[tp] for tp in task.inputs]
            ref = named_checkpoint(task, tp_committed)
            for c in tp_committed:
                if c.offset >= 0:
                    positions[(c.topic, c.partition)] = c.offset
            if ref is None:
                _check_offsets_not_lost(storage, pipeline.name, task.task_id)
                continue
            count = stage_partitions[task.stage]
            jobs.append(
                ExportJob(
                    job=pipeline.name,
                    task_id=task.task_id,
                    ref=ref,
                    checkpoint_dir=checkpoint_dir,
                    target=target,
                    scratch=f"{scratch}/{task.task_id}",
                    backend=pipeline.state_backend,
                    backend_options=dict(pipeline.state_backend_options),
                    operator_uids=pipeline.operator_uids(),
                    partition=task.partition,
                    stage_tasks=None if task.stage == SOURCE_STAGE else count,
                    max_parallelism=pipeline.max_parallelism,
                )
            )
            state_bytes += _state_bytes(storage, pipeline.name, task.task_id, ref)

        def tell(done: int, total: int) -> None:
            if progress is not None:
                progress("state", done, total)

        tell(0, len(jobs))
        processes = pool_size(len(jobs), state_bytes=state_bytes)
        for exported in run_jobs(export_task, jobs, processes, tell):
            meta = exported.meta
            positions.update(meta.positions)
            _merge_topic_ids(topic_ids, meta.topic_ids, sources, meta.task_id)
            if meta.time:
                clocks[meta.task_id] = meta.time
            for uid, entry in exported.files.items():
                files[uid].append(entry)
                partitioning[uid] = "source" if entry.key_groups is None else "keyed"
                states[uid] = [
                    state_description(d)
                    for d in meta.states
                    if (d.get("uid") or pipeline.operator_uids().get(int(d["operator"]))) == uid
                ]
        if progress is not None:
            progress(_state_progress(files), len(jobs), len(jobs))
        in_flight = []
        for rep in plan.repartitions.values():
            if progress is not None:
                progress(f"in flight: {rep.topic}", 0, 1)
            starts = {
                p: (
                    positions[(rep.topic, p)]
                    if (rep.topic, p) in positions
                    else _low(admin, kafka_config, rep.topic, p)  # a client each: only if needed
                )
                for p in range(partitions[rep.topic])
            }
            table = read_in_flight(
                kafka_config,
                rep.topic,
                starts,
                max(IN_FLIGHT_TIMEOUT, job_transaction_timeout(pipeline) + 30),
            )
            entry = write_table(out, f"in-flight/{rep.name}.parquet", table)
            in_flight.append(InFlight(rep.name, rep.topic, partitions[rep.topic], [entry]))
        # The records in flight were read to the topics' ends now, not at the checkpoints: a
        # worker that committed meanwhile (resumed after the pause limit, or started during
        # the export) added records whose sources the savepoint reads again, and may have
        # deleted some it needs. Its commit moved the group's offsets, atomically with them.
        _check_unmoved(kafka_config, pipeline.name, committed)
        source_offsets: dict[str, dict[int, int]] = defaultdict(dict)
        for (topic, p), offset in positions.items():
            if topic in pipeline.source_topics():
                source_offsets[topic][p] = offset
        metadata = SavepointMetadata(
            pipeline=pipeline.name,
            snapline_version=SNAPLINE_VERSION,
            max_parallelism=pipeline.max_parallelism,
            source_offsets=dict(source_offsets),
            source_partitions={t: partitions[t] for t in pipeline.source_topics()},
            operators=[
                OperatorState(uid, partitioning[uid], states[uid], files[uid]) for uid in files
            ],
            in_flight=in_flight,
            cluster_id=cluster_id,
            origin=origin,
            clocks=clocks,
            highest_checkpoint_id=highest,
            stage_reads=stage_reads(plan),
            source_topic_ids=topic_ids,
            topic_generations=dict(pipeline.topic_generations),
        )
        out.write_bytes(METADATA_FILE, metadata.encode())  # last: the savepoint is complete
        return metadata
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_offsets_not_lost(storage: CheckpointStorage, job: str, task_id: str) -> None:
    """A task whose partitions have no committed offsets starts like a new task: right when
    it never committed a checkpoint, but not when one is marked committed. Then the group's
    offsets vanished (expired while the job was stopped, or a source topic deleted and created
    again), and a savepoint without the task would restore it with empty state, silently. The
    worker's restore refuses the same case and names the choices (``--restore-latest``,
    ``--reset-state``, ``--read-recreated-topics``)."""
    marked = [
        ref
        for ref in list_checkpoints(storage, job, task_id)
        if is_marked_committed(storage, job, task_id, ref)
    ]
    if marked:
        raise CheckpointError(
            f"task {task_id} committed checkpoint {marked[-1].checkpoint_id}, but the consumer "
            f"group {job!r} has no committed offsets of its partitions any more (expired while "
            "the job was stopped, or a source topic deleted and created again): a savepoint "
            "would lose its state. Start the job once; its restore names the choices "
            "(--restore-latest, --reset-state, --read-recreated-topics). Then take the "
            "savepoint"
        )


def _merge_topic_ids(
    ids: dict[str, str], found: dict[str, str], sources: set[str], task_id: str
) -> None:
    """Add the source topic ids a task's checkpoint recorded to ``ids``. Two checkpoints
    that name two ids of one topic read two topics of that name: the savepoint's offsets
    would mix them."""
    for topic, found_id in found.items():
        if topic not in sources or not found_id:
            continue
        known = ids.setdefault(topic, found_id)
        if ids_differ(known, found_id):
            raise CheckpointError(
                f"the job's checkpoints read two topics named {topic} (ids {known} and "
                f"{found_id}, task {task_id}): it was deleted and created again while the "
                "job ran, and some tasks have not committed since. Let every task commit a "
                "checkpoint (restart the job with --read-recreated-topics), then take the "
                "savepoint again"
            )


def publish_committed_sinks(pipeline: Pipeline, storage: CheckpointStorage, admin: Any) -> None:
    """Publish what the job's committed checkpoints staged in its Parquet and PostgreSQL
    sinks and no worker published: one died between Kafka's commit and the sinks' publish,
    and the job was then left stopped. A restarted worker would publish it; the seeded
    checkpoint lists no staged output, so its recovery would discard it as never committed,
    and Kafka would hold records the table and the database never get.

    It works from the old job's layout, not the code's (which may have renumbered stages):
    each task directory's checkpoint that the group's committed offsets name for every
    partition it read; its sinks (by name) recover it under the old task id, as a worker's
    recovery does. The job is stopped (checked by the caller). ``savepoint from-checkpoint``
    runs it too: a restore into another checkpoint storage cannot see these checkpoints."""
    from snapline.sinks.parquet import ParquetSink

    staging: tuple[type, ...] = (ParquetSink,)
    try:
        from snapline.sinks.postgres import PostgresSink

        staging += (PostgresSink,)
    except ImportError:  # psycopg not installed: the job has no PostgreSQL sink
        pass
    sinks = {sink.name: sink for sink in pipeline.sinks() if isinstance(sink, staging)}
    if not sinks:
        return
    try:
        future = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(pipeline.name)], request_timeout=30
        )[pipeline.name]
        offsets = future.result(timeout=35).topic_partitions or []
    except KafkaException as exc:
        raise CheckpointError(
            f"cannot read the committed offsets of {pipeline.name}: {exc}"
        ) from exc
    named: dict[tuple[str, int], CheckpointRef] = {}
    for tp in offsets:
        ref = CheckpointRef.parse_offset_metadata(tp.metadata) if tp.offset >= 0 else None
        if ref is not None:
            named[(tp.topic, tp.partition)] = ref

    refs = set(named.values())
    for task_id in storage.list_dir(f"{pipeline.name}/tasks"):
        for ref in refs:
            if not storage.exists(f"{ref.directory(pipeline.name, task_id)}/{CHECKPOINT_METADATA}"):
                continue
            meta = TaskCheckpoint.read(storage, pipeline.name, task_id, ref)
            if not meta.positions or any(named.get(tp) != ref for tp in meta.positions):
                continue  # not the checkpoint Kafka names for this task
            publish_staged(
                pipeline, sinks, task_id, departed.SEEDED, ref.checkpoint_id, meta.sinks, None
            )


def stage_reads(plan: StagePlan) -> dict[int, list[str]]:
    """What each stage reads, as a savepoint records it (``_read_names``)."""
    return {stage.index: _read_names(plan, stage.reads) for stage in plan.stages}


def _read_names(plan: StagePlan, topics: Any) -> list[str]:
    """The names of the ``key_by``s whose repartition topics a stage reads (sorted): they
    name a stage across code versions and job names, where its number and topics do not."""
    names = {rep.topic: rep.name for rep in plan.repartitions.values()}
    return sorted(names.get(topic, topic) for topic in topics)


def _low(admin: AdminClient, kafka_config: dict[str, Any], topic: str, partition: int) -> int:
    consumer = Consumer({**kafka_config, "group.id": "snapline-savepoint-low"})
    try:
        return int(consumer.get_watermark_offsets(TopicPartition(topic, partition), 30)[0])
    finally:
        consumer.close()
