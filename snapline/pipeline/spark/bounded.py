"""The same pipeline on Spark, bounded (DESIGN §10): ``snapline spark run`` reads an offset range
of the source topics with Spark's Kafka source and runs the declared stages on the executors.

How a stage runs: its input is partitioned like the services' tasks (stage 0 by source
partition, a keyed stage by key-group range: the repartition topic becomes a Spark shuffle),
sorted in the order a service task would read it (offset order per source partition;
upstream-task order for shuffled records), and each Spark task runs a real Snapline ``Task``
(the same operators, state API and sink writers as a worker) over it with in-memory state,
then takes one checkpoint, with the services' commit protocol:

1. the sinks pre-commit (Parquet stages files, PostgreSQL stages rows); their pre-commit
   results are written to ``<checkpoint dir>/<job>/spark/<run>/<task>-<attempt>.json``;
2. the Kafka output goes in one transaction (``transactional.id``
   ``snapline-spark-<job>-spark-<run>-<task>``: per job, run and task, so a retry fences an
   earlier attempt and nothing else) that also commits an offset for the **ledger** group
   ``snapline-spark-<run>-<task>``, with the attempt's token as its metadata: the commit
   point. The output is held (in memory, then spilled to a local file) while the task runs,
   and the transaction opens only when it has run: a task slower than
   ``transaction.timeout.ms`` commits like any other;
3. the other sinks commit (publish), as after a services checkpoint.

Every attempt fences the earlier ones (``init_transactions``) before it reads the ledger; a
retried (or speculative) attempt that finds the ledger committed produces nothing to Kafka,
discards its own staged output and re-publishes what the committed attempt staged
(``recover``), so Kafka, Parquet and PostgreSQL see each input once. Parquet readers see the
run per committed Spark task. At the end the run writes a savepoint (the state of every task
and the end offsets) from which ``snapline run --from-savepoint`` continues live; a run can
also start from a services' savepoint (``--from savepoint:URI``).

Threads: the driver's main thread; each Spark task in its executor's Python worker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson
from confluent_kafka import KafkaException

from snapline.connectors.config import redact_text
from snapline.pipeline.errors import CheckpointError, ConfigurationError
from snapline.pipeline.runtime.transaction import record_size, too_large
from snapline.pipeline.state.compat import state_description

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class RunConfig:
    """Everything a Spark task needs (plain data: it is pickled to the executors)."""

    spec: str
    run_id: str
    kafka_config: dict[str, Any]
    checkpoint_dir: str
    savepoint_out: str
    savepoint_in: str | None
    stage_partitions: dict[int, int]
    #: (uid, state name) -> new state id, for state restored from savepoint_in
    mapping: dict[tuple[str, str], Any] = field(default_factory=dict)
    #: A run that a version before per-job transactional ids may have run: each task also
    #: fences the transactional id such a version gave it (``_legacy_transactional_id``).
    fence_legacy_ids: bool = False
    #: Task id (``task_id_for``) -> its clock from savepoint_in (savepoint/restore.py
    #: ``_clock``): event time goes on from the services' instead of starting over.
    clocks: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunResult:
    run_id: str
    records: dict[int, int]
    savepoint: str
    seconds: float
    source_records: int


def _ms(value: Any) -> int:
    if isinstance(value, datetime):  # not from the Kafka source, which gives int ms
        return int(value.timestamp() * 1000)
    return int(value or 0)


#: Kafka output a Spark task holds in memory before it spills it to a local file.
SPILL_BYTES = 64 << 20


class _Output:
    """The task's output: repartition records to the next stage's shuffle, the rest held for
    Kafka until ``send`` (or nowhere for an attempt whose ledger already committed).

    Held, not produced at once: the broker aborts a transaction ``transaction.timeout.ms``
    after its first record, and a Spark task may run for longer than that (a large
    partition), so the transaction opens once the task has run. What is held past
    ``SPILL_BYTES`` goes to a temporary file in Spark's local directory."""

    def __init__(self, kafka: Any, repartitioned: set[str]) -> None:
        self.kafka = kafka
        self.repartitioned = repartitioned
        #: The producer's limit: a record over it is refused when produced, as the producer
        #: would refuse it (the Kafka sink then dead-letters its input; Task._fits).
        self.max_message_bytes: int | None = getattr(kafka, "max_message_bytes", None)
        self.shuffled: list[tuple[str, int, bytes | None, bytes | None, int]] = []
        self._held: list[tuple[Any, ...]] = []
        self._held_bytes = 0
        self._spill: Any = None

    def direct_producer(self, epoch: int) -> None:
        """No direct path: repartition records are routed to the shuffle by ``produce``."""
        return None

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
        if topic in self.repartitioned:
            self.shuffled.append((topic, partition, key, value, timestamp))
        elif self.kafka is not None:
            size = record_size(value, key, headers)
            if self.max_message_bytes is not None and size > self.max_message_bytes:
                raise too_large(size, self.max_message_bytes)
            # A copy: the encoder's buffer behind a small value can be 4 KiB.
            value = None if value is None else b"%b" % value
            self._held.append((topic, value, key, headers, partition, timestamp))
            self._held_bytes += 200 + size  # with the tuple's and the objects' overhead
            if self._held_bytes > SPILL_BYTES:
                self._spill_held()

    def _spill_held(self) -> None:
        if self._spill is None:
            local = os.environ.get("SPARK_LOCAL_DIRS", "").split(",")[0]
            # Closed by close() (the task's finally); deleted by the OS when closed.
            self._spill = tempfile.TemporaryFile(prefix="snapline-output-", dir=local or None)  # noqa: SIM115
        pickle.dump(self._held, self._spill, protocol=pickle.HIGHEST_PROTOCOL)
        self._held, self._held_bytes = [], 0

    def send(self, epoch: int) -> int:
        """Open the transaction of ``epoch`` and produce every held record into it, in the
        order the task produced them; returns how many."""
        assert self.kafka is not None
        self.kafka.begin(epoch)
        sent = 0
        if self._spill is not None:
            self._spill.seek(0)
            while True:
                try:
                    chunk = pickle.load(self._spill)
                except EOFError:
                    break
                for record in chunk:
                    self.kafka.produce(epoch, *record)
                sent += len(chunk)
        for record in self._held:
            self.kafka.produce(epoch, *record)
        return sent + len(self._held)

    def close(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None
        self._held = []


def _ledger_group(config: RunConfig, task_id: str) -> str:
    return f"snapline-spark-{config.run_id}-{task_id}"


def _transactional_id(job: str, task_id: str) -> str:
    """The transactional id of a Spark task's Kafka output: every attempt of the task of this
    job and run has it (a retry fences the earlier attempts), no other job's task has it."""
    return f"snapline-spark-{job}-{task_id}"


def _legacy_transactional_id(config: RunConfig, task_id: str) -> str:
    """What versions before per-job ids used: the same for two jobs' runs of one run id, whose
    tasks then fenced each other's transactions for as long as both ran."""
    return f"snapline-spark-{config.run_id}-{task_id}"


def _used_legacy_ids(storage: Any, job: str, run_id: str) -> bool:
    """Whether attempts of run ``run_id`` may have run under a version with legacy
    transactional ids: its recorded range does not say otherwise, or (a version before
    recorded ranges) the run left records and no range."""
    from snapline.pipeline.checkpoint.metadata import decode_checked

    path = f"{job}/spark/{run_id}/_range.json"
    if storage.exists(path):
        body = decode_checked(storage.read_bytes(path), storage.full_path(path))
        return bool(body.get("transactional_ids") != "job")
    return bool(storage.list_dir(f"{job}/spark/{run_id}"))


class Feed:
    """A Spark task's sorted rows ``(topic, offset, key, value, timestamp)``, handed to its
    Snapline task in chunks (``into``), and ``at_end``, the task's ``source_ends``: a source
    partition is at its end once every one of its rows was handed over, and only then may
    its clock call it idle. With the wall clock alone (there is no Kafka to ask), a topic
    whose rows come after another's (they are fed in offset order) went idle while its rows
    waited, and they were late: windows fired without them, differently from run to run."""

    CHUNK = 2048

    def __init__(self, rows: Iterable[tuple[Any, ...]], partition: int) -> None:
        self.rows = list(rows)
        self.partition = partition
        self._unfed = Counter(row[0] for row in self.rows)

    def at_end(self, tp: tuple[str, int], since: float = 0.0) -> bool:
        return self._unfed[tp[0]] == 0

    def into(self, task: Any) -> int:
        """Hand every row to ``task`` (``enqueue`` and ``run`` per chunk); returns how many."""
        from snapline.pipeline.record import ListedMessage

        batch: list[ListedMessage] = []
        current: str | None = None

        def flush() -> None:
            if batch:
                self._unfed[current or ""] -= len(batch)  # handed over before the task runs
                task.enqueue((current or "", self.partition), list(batch))
                task.run()
                batch.clear()

        for topic, offset, key, value, ts in self.rows:
            if topic != current:
                flush()
                current = topic
            batch.append(ListedMessage(topic, self.partition, offset, value, key, ts))
            if len(batch) >= self.CHUNK:
                flush()
        flush()
        return len(self.rows)


def run_stage_task(
    config: RunConfig, stage: int, partition: int, rows: Iterable[tuple[Any, ...]]
) -> Iterator[tuple[Any, ...]]:
    """One Spark task: a Snapline task of ``stage`` over its sorted input (see module)."""
    from concurrent.futures import Future

    from confluent_kafka import Consumer, TopicPartition

    from snapline.pipeline.checkpoint.metadata import (
        CheckpointRef,
        TaskCheckpoint,
        decode_checked,
        encode_checked,
    )
    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.graph import load_pipeline
    from snapline.pipeline.keygroups import key_group_range
    from snapline.pipeline.runtime.faults import FaultInjector
    from snapline.pipeline.runtime.task import Task, TaskSnapshot
    from snapline.pipeline.runtime.transaction import TransactionalOutput
    from snapline.pipeline.savepoint.control import control_topic
    from snapline.pipeline.savepoint.export import export_task_state
    from snapline.pipeline.savepoint.format import read_metadata, write_table
    from snapline.pipeline.savepoint.markers import use_topic_generations
    from snapline.pipeline.savepoint.restore import _load_operator
    from snapline.pipeline.stages import SOURCE_STAGE, task_id_for
    from snapline.pipeline.state import create_backend

    pipeline = load_pipeline(config.spec)
    storage = CheckpointStorage(config.checkpoint_dir)
    use_topic_generations(pipeline, storage)  # the job's repartition topics
    plan = pipeline.stages()
    task_id = f"spark-{config.run_id}-{task_id_for(stage, partition)}"
    # This attempt's pre-commit record: its token is also the metadata of the ledger offset it
    # commits, so a retry reads the record of the attempt that committed, never one that an
    # older attempt (fenced, still running: speculation, a lost executor) wrote after it.
    token = uuid.uuid4().hex[:12]

    def precommit_path(attempt: str) -> str:
        suffix = f"-{attempt}" if attempt else ""  # none: a record of a version before tokens
        return f"{pipeline.name}/spark/{config.run_id}/{task_id}{suffix}.json"

    control = TopicPartition(control_topic(pipeline.name), 0)
    #: Written once the task's Kafka transaction committed: outlives the ledger's offsets.
    committed_mark = f"{pipeline.name}/spark/{config.run_id}/{task_id}.committed"
    ledger = Consumer(
        {
            **config.kafka_config,
            "group.id": _ledger_group(config, task_id),
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    kafka: TransactionalOutput | None = TransactionalOutput(
        {**config.kafka_config, "client.id": task_id},
        transactional_id=_transactional_id(pipeline.name, task_id),
    )
    output: _Output | None = None
    try:
        # init_transactions first: it fences every earlier attempt of this task (an open
        # transaction of theirs is aborted, none can commit later), so the ledger read next
        # is final. An attempt of an older version had another id: fenced too, if there may
        # have been one.
        if config.fence_legacy_ids:
            legacy = TransactionalOutput(
                {**config.kafka_config, "client.id": task_id},
                transactional_id=_legacy_transactional_id(config, task_id),
            )
            legacy.init()
            legacy.close()
        assert kafka is not None
        kafka.init()
        (ledger_offset,) = ledger.committed([control], timeout=30)
        if ledger_offset.error is not None:  # read as "not committed", it would commit twice
            raise CheckpointError(
                f"cannot read the ledger of task {task_id}: {ledger_offset.error}"
            )
        committed = ledger_offset.offset >= 1
        if not committed and storage.exists(committed_mark):
            # The ledger is a consumer group's offset, which Kafka deletes
            # offsets.retention.minutes (7 days) after its commit; the mark is not.
            raise CheckpointError(
                f"task {task_id} of run {config.run_id} committed its output before "
                f"({redact_text(storage.full_path(committed_mark))}), but the run's ledger in "
                "Kafka no longer says so: its offsets expired (offsets.retention.minutes). "
                "Running it again would write that output twice; start a new run (another "
                "--run-id)"
            )
        if committed:
            kafka.close()
            kafka = None
        repartitioned = {rep.topic for rep in plan.repartitions.values()}
        output = _Output(kafka, repartitioned)
        reads = plan.stages[stage].reads
        partitions = {topic: config.stage_partitions[stage] for topic in reads}
        for rep in plan.repartitions.values():
            partitions[rep.topic] = config.stage_partitions[rep.downstream]
        backend = create_backend("memory", task_dir="", options={})
        if config.savepoint_in:
            sp = CheckpointStorage(config.savepoint_in)
            meta = read_metadata(sp)
            uids = pipeline.operator_uids()
            stage_nodes = plan.stages[stage].node_ids
            for op in meta.operators:
                nodes = [n for n, u in uids.items() if u == op.uid and n in stage_nodes]
                if nodes and any(uid == op.uid for uid, _ in config.mapping):
                    _load_operator(
                        backend,
                        sp,
                        op,
                        config.mapping,
                        partition,
                        partitions,
                        reads,
                        pipeline.max_parallelism,
                    )
        inputs = reads or tuple(pipeline.source_topics())
        feed = Feed(rows, partition)
        snapshots: list[TaskSnapshot] = []
        task = Task(
            task_id,
            pipeline,
            {(topic, partition): 0 for topic in inputs},
            backend,
            output,  # type: ignore[arg-type]
            worker_id="spark",
            epoch=1,
            on_snapshot=snapshots.append,
            faults=FaultInjector(""),
            stage=stage,
            plan=plan,
            topic_partitions=partitions,
            source_ends=feed.at_end,
            time_state=config.clocks.get(task_id_for(stage, partition)),
        )
        if not committed:
            task.recover_sinks(None, {})
        records = feed.into(task)
        task.inject_barrier(1)
        task.run()
        (snapshot,) = snapshots
        sinks: dict[str, Any] = {}
        for name, result in snapshot.sinks.items():
            if isinstance(result, Future):
                result = result.result(timeout=600)
            if result:
                sinks[name] = result
        if committed:  # an earlier attempt passed the commit point: publish what it staged
            record = precommit_path(ledger_offset.metadata or "")
            previous = decode_checked(storage.read_bytes(record), record, "sinks")["sinks"]
            for name, sink_op in task.sink_writers.items():
                sink_op.writer.abort(1)
                sink_op.writer.recover(1, previous.get(name))
        else:
            storage.write_bytes(precommit_path(token), encode_checked({"sinks": sinks}))
            assert kafka is not None
            output.send(1)
            kafka.commit(
                [TopicPartition(control.topic, 0, 1, metadata=token)],
                ledger.consumer_group_metadata(),
            )
            storage.write_bytes(committed_mark, token.encode())
            _inject_fault(task_id)
            task.notify_committed(1)
        # The task's state, for the savepoint the run ends with.
        states = [
            {**desc.describe(), "id": sid, "operator": node_id, "uid": uids_}
            for node_id, entries in pipeline.state_ids().items()
            for sid, desc in entries
            for uids_ in [pipeline.operator_uids()[node_id]]
        ]
        fake = TaskCheckpoint(
            pipeline.name, task_id, CheckpointRef(1, "spark"), "spark", {}, None, states=states
        )
        out = CheckpointStorage(config.savepoint_out)
        for uid, table in export_task_state(pipeline, fake, backend).items():
            if stage == SOURCE_STAGE:
                entry = write_table(
                    out, f"operators/{uid}/p{partition:05d}.parquet", table, partition=partition
                )
                partitioning = "source"
            else:
                groups = key_group_range(
                    partition, config.stage_partitions[stage], pipeline.max_parallelism
                )
                entry = write_table(
                    out,
                    f"operators/{uid}/kg-{groups.start:05d}-{groups.stop - 1:05d}.parquet",
                    table,
                    key_groups=(groups.start, groups.stop - 1),
                    partition=partition,
                )
                partitioning = "keyed"
            yield ("state", uid, partitioning, orjson.dumps(entry.to_json()))
        # The task's clock, for the savepoint: the services go on from its event time.
        yield ("clock", task_id_for(stage, partition), orjson.dumps(task.clock.snapshot()))
        task.close()
        for seq, (topic, target, key, value, ts) in enumerate(output.shuffled):
            yield ("shuffle", topic, target, (stage, partition, seq), key, value, ts)
        yield ("count", stage, records, len(output.shuffled))
    finally:
        ledger.close()
        if output is not None:
            output.close()
        if kafka is not None:
            kafka.close()


def _inject_fault(task_id: str) -> None:
    """Tests: fail the first attempt of the named task after its commit point."""
    import os

    from pyspark import TaskContext

    target = os.environ.get("SNAPLINE_SPARK_FAIL_AFTER_COMMIT", "")
    context = TaskContext.get()
    if target and task_id.endswith(target) and context is not None and not context.attemptNumber():
        raise RuntimeError(f"injected failure of {task_id} after its commit point")


def _offsets(text: str, admin: Any, consumer: Any, topics: list[str], latest: bool) -> dict:
    """``earliest``/``latest`` or JSON ``{"topic": {"0": offset}}`` to {(topic, p): offset}."""
    from confluent_kafka import TopicPartition

    metadata = admin.list_topics(timeout=30)
    result = {}
    for topic in topics:
        for p in metadata.topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            result[(topic, p)] = high if latest else low
    if text not in ("earliest", "latest"):
        try:
            given = json.loads(text)
            for topic, parts in given.items():
                for p, offset in parts.items():
                    result[(topic, int(p))] = int(offset)
        except (ValueError, AttributeError) as exc:
            raise ConfigurationError(
                f"{text!r}: use earliest, latest, savepoint:URI or JSON like "
                '{"orders": {"0": 1200, "1": 980}}'
            ) from exc
    return result


def run_bounded(
    spec: str,
    kafka_config: dict[str, Any],
    checkpoint_dir: str,
    *,
    start: str = "earliest",
    end: str = "latest",
    master: str = "local[*,4]",
    savepoint_out: str | None = None,
    run_id: str | None = None,
    progress: Progress | None = None,
) -> RunResult:
    """Run ``spec`` over the source range [start, end) on Spark (see module)."""
    import os
    import sys

    from confluent_kafka import Consumer
    from confluent_kafka.admin import AdminClient

    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.graph import load_pipeline
    from snapline.pipeline.runtime.topics import (
        TopicManager,
        cluster_id_of,
        describe_topic_ids,
        pipeline_topics,
        recreated_since,
    )
    from snapline.pipeline.savepoint.control import ensure_control_topic
    from snapline.pipeline.savepoint.export import (
        SNAPLINE_VERSION,
        default_savepoint_uri,
        stage_reads,
    )
    from snapline.pipeline.savepoint.format import (
        METADATA_FILE,
        InFlight,
        OperatorState,
        SavepointFile,
        SavepointMetadata,
        read_metadata,
        read_table,
    )
    from snapline.pipeline.savepoint.markers import use_topic_generations
    from snapline.pipeline.savepoint.restore import match_states
    from snapline.pipeline.spark.jars import spark_session

    say = progress or (lambda message: log.info("%s", message))
    started = time.monotonic()
    sys.path.insert(0, os.getcwd())
    pipeline = load_pipeline(spec)
    pipeline.validate()
    if not pipeline.exactly_once:
        raise ConfigurationError("snapline spark run needs guarantee='exactly_once'")
    run_id = run_id or uuid.uuid4().hex[:8]
    where = str(kafka_config.get("bootstrap.servers"))
    use_topic_generations(pipeline, CheckpointStorage(checkpoint_dir))  # its repartition topics
    plan = pipeline.stages()
    topic_plan = TopicManager(kafka_config, where).ensure(pipeline_topics(pipeline))
    ensure_control_topic(kafka_config, pipeline.name)
    sources = pipeline.source_topics()
    default = max(topic_plan.partitions[t] for t in sources)
    stage_partitions = {0: default}
    for rep in plan.repartitions.values():
        stage_partitions[rep.downstream] = topic_plan.partitions.get(rep.topic, default)
    admin = AdminClient(kafka_config)
    topic_ids = describe_topic_ids(admin, sources, "source topics")
    cluster = cluster_id_of(admin)
    probe = Consumer({**kafka_config, "group.id": f"snapline-spark-probe-{run_id}"})
    savepoint_in = None
    mapping: dict[tuple[str, str], Any] = {}
    clocks: dict[str, Any] = {}
    in_flight: list[tuple[str, bytes, bytes, int, int]] = []
    try:
        if start.startswith("savepoint:"):
            savepoint_in = start.split(":", 1)[1]
            saved = read_metadata(CheckpointStorage(savepoint_in))
            recreated = recreated_since(saved.topic_ids_on(cluster), topic_ids)
            if recreated:
                raise ConfigurationError(
                    f"source topics {', '.join(recreated)} were deleted and created again "
                    "since the savepoint was taken: its offsets are offsets of the old "
                    "topics, and a run from them would skip or repeat records of the new "
                    "ones. Restore the savepoint into the services with --from-savepoint "
                    "--read-recreated-topics (they read the new topics from their start)"
                )
            mapping = match_states(pipeline, saved, allow_non_restored=False)
            _check_source_state_placed(saved, mapping, sources)
            clocks = _clocks_from(saved, plan, stage_partitions)
            starts = _offsets("earliest", admin, probe, sources, latest=False)
            for topic, parts in saved.source_offsets.items():
                for p, offset in parts.items():
                    starts[(topic, p)] = offset
            sp = CheckpointStorage(savepoint_in)
            by_name = {rep.name: rep for rep in plan.repartitions.values()}
            for flight in saved.in_flight:
                for entry in flight.files:
                    cols = read_table(sp, entry).to_pydict()
                    for key, value, ts, off in zip(
                        cols["key"], cols["value"], cols["timestamp"], cols["offset"], strict=True
                    ):
                        in_flight.append((by_name[flight.name].topic, key, value, ts, off))
        else:
            starts = _offsets(start, admin, probe, sources, latest=False)
        ends = _offsets(end, admin, probe, sources, latest=True)
        storage = CheckpointStorage(checkpoint_dir)
        fence_legacy_ids = _used_legacy_ids(storage, pipeline.name, run_id)
        starts, ends = _run_range(storage, pipeline.name, run_id, starts, ends, say, start)
        _check_range(probe, starts, ends)
    finally:
        probe.close()
    total = sum(max(0, ends[tp] - starts[tp]) for tp in ends)
    say(
        f"run {run_id}: {total} source records in {len(ends)} partitions, stages {len(plan.stages)}"
    )
    savepoint_out = savepoint_out or default_savepoint_uri(checkpoint_dir, pipeline.name)
    if CheckpointStorage(savepoint_out).exists(METADATA_FILE):
        raise ConfigurationError(f"{redact_text(savepoint_out)} already holds a savepoint")
    config = RunConfig(
        spec,
        run_id,
        kafka_config,
        checkpoint_dir,
        savepoint_out,
        savepoint_in,
        stage_partitions,
        mapping,
        fence_legacy_ids,
        clocks,
    )
    spark = spark_session(
        master,
        f"snapline-{pipeline.name}-{run_id}",
        max(stage_partitions.values()),
        {"spark.ui.showConsoleProgress": "true"},
    )
    try:
        reader = (
            spark.read.format("kafka")
            .option("kafka.bootstrap.servers", where)
            .option("kafka.isolation.level", "read_committed")
            .option(
                "assign", json.dumps({t: sorted(p for (tt, p) in ends if tt == t) for t in sources})
            )
            .option("startingOffsets", json.dumps(_by_topic(starts)))
            .option("endingOffsets", json.dumps(_by_topic(ends)))
            # Records of the range that Kafka deletes while the run reads them (retention,
            # delete-records) fail the run; "false" skipped them with a log warning.
            .option("failOnDataLoss", "true")
        )
        for key, value in pipeline.kafka_config.items():
            reader = reader.option(f"kafka.{key}", str(value))
        # The timestamp as Spark's own milliseconds: a Python datetime of it lost 1 ms to
        # float rounding for some (before 1970, after 2038), moving records between windows.
        df = reader.load().selectExpr(
            "topic", "partition", "offset", "key", "value", "unix_millis(timestamp) AS ts"
        )
        source = df.rdd.map(lambda r: (r[1], (r[0], r[2], r[3], r[4], _ms(r[5])))).partitionBy(
            stage_partitions[0], lambda p: p
        )
        pending: dict[int, list[Any]] = {}
        if in_flight:
            flight_rdd = spark.sparkContext.parallelize(
                [
                    (
                        topic,
                        _target(key, plan, topic, stage_partitions, pipeline.max_parallelism),
                        (-1, 0, off),
                        key,
                        value,
                        ts,
                    )
                    for topic, key, value, ts, off in in_flight
                ]
            )
            for rep in plan.repartitions.values():
                pending.setdefault(rep.downstream, []).append(
                    flight_rdd.filter(_topic_is(rep.topic, 0))
                )
        stage_rdds = _stage_rdds(
            plan, source, pending, stage_partitions, lambda k: _stage_runner(config, k)
        )
        records: dict[int, int] = {}
        files: dict[str, list[SavepointFile]] = {}
        partitioning: dict[str, str] = {}
        out_clocks: dict[str, dict[str, Any]] = {}
        for k, result in stage_rdds.items():
            for row in result.filter(lambda r: r[0] in ("state", "count", "clock")).collect():
                if row[0] == "count":
                    records[k] = records.get(k, 0) + row[2]
                elif row[0] == "clock":
                    out_clocks[row[1]] = orjson.loads(row[2])
                else:
                    files.setdefault(row[1], []).append(
                        SavepointFile.from_json(orjson.loads(row[3]))
                    )
                    partitioning[row[1]] = row[2]
            say(f"stage {k}: {records.get(k, 0)} records processed")
        files = files_as_written(CheckpointStorage(savepoint_out), files, say)
        uids = pipeline.operator_uids()
        states = {
            uids[node_id]: [state_description(d.describe()) for _, d in entries]
            for node_id, entries in pipeline.state_ids().items()
        }
        metadata = SavepointMetadata(
            pipeline=pipeline.name,
            snapline_version=SNAPLINE_VERSION,
            max_parallelism=pipeline.max_parallelism,
            source_offsets=_by_topic_int(ends),
            source_partitions={t: topic_plan.partitions[t] for t in sources},
            operators=[
                OperatorState(uid, partitioning[uid], states[uid], sorted(fs, key=lambda f: f.path))
                for uid, fs in files.items()
            ],
            in_flight=[
                InFlight(r.name, r.topic, stage_partitions[r.downstream], [])
                for r in plan.repartitions.values()
            ],
            origin=f"spark:{run_id}",
            clocks=out_clocks,
            stage_reads=stage_reads(plan),
            source_topic_ids=topic_ids,
            topic_generations=dict(pipeline.topic_generations),
            cluster_id=cluster,
        )
        CheckpointStorage(savepoint_out).write_bytes(METADATA_FILE, metadata.encode())
        # Printed, not logged (no redacting filter on the way), and a default savepoint URI
        # carries the checkpoint dir's credentials.
        say(f"savepoint at the end offsets: {redact_text(savepoint_out)}")
        for result in stage_rdds.values():
            result.unpersist()
    finally:
        spark.stop()
    return RunResult(run_id, records, savepoint_out, time.monotonic() - started, total)


def files_as_written(
    storage: Any, files: dict[str, list[Any]], say: Callable[[str], None]
) -> dict[str, list[Any]]:
    """The savepoint's state file entries (by operator uid) as the files now are.

    A stage's tasks are run again when Spark lost the results it kept (memory, an executor)
    and a later stage needs them, or as speculative attempts. An attempt after the task's
    commit writes no output, but exports the task's state again to the same file, after the
    driver had collected the first attempt's entry: the bytes differ where state carries
    the wall clock (TTL stamps, processing-time timers), and the savepoint's restore then
    failed the file's checksum, every time. Every attempt's state is that of the committed
    output, so the file as written last is taken: its size, rows and checksum are read
    again here (once every Spark job of the run is done)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from snapline.pipeline.checkpoint.storage import crc32_checksum

    out: dict[str, list[Any]] = {}
    for uid, entries in files.items():
        for entry in entries:
            data = storage.read_bytes(entry.path)
            checksum = crc32_checksum(data)
            if checksum != entry.checksum or len(data) != entry.size:
                rows = pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows
                say(
                    f"{redact_text(entry.path)} was written again by another attempt of its "
                    "task after its first entry was taken: the savepoint names the file as it "
                    "is now"
                )
                entry = dataclasses.replace(entry, rows=rows, size=len(data), checksum=checksum)
            out.setdefault(uid, []).append(entry)
    return out


def _check_source_state_placed(saved: Any, mapping: dict[Any, Any], sources: list[str]) -> None:
    """Source-stage state is per partition of the topics it was read from, and is restored
    with the savepoint's offsets of those topics. A source topic the savepoint has no offsets
    of (renamed, mirrored) starts at its earliest offset: its partition's state would then
    count the records read again (the services' restore refuses it the same way,
    ``seeded_tasks``)."""
    uids = {uid for uid, _ in mapping}
    stateful = [
        op.uid
        for op in saved.operators
        if op.uid in uids and op.partitioning == "source" and any(f.rows for f in op.files)
    ]
    missing = sorted(t for t in sources if not saved.source_offsets.get(t))
    if stateful and missing:
        raise ConfigurationError(
            f"the savepoint holds source-stage state of operators {', '.join(stateful)} and "
            f"no offsets of source topics {', '.join(missing)} (its offsets are of "
            f"{', '.join(sorted(saved.source_offsets)) or 'no topic'}): the state would be "
            "restored while those topics are read from their start. Run from the savepoint "
            "with the source topics it was taken from, or restore it into the services with "
            "--allow-non-restored-state to drop that state"
        )


def _clocks_from(saved: Any, plan: Any, stage_partitions: dict[int, int]) -> dict[str, Any]:
    """Each task's clock from a services' savepoint, as a restore gives it (``_clock``: with
    the key-group floors of a rescale)."""
    from snapline.pipeline.savepoint.restore import _clock, _old_stages, _task_counts
    from snapline.pipeline.stages import task_id_for

    partitions = {rep.topic: stage_partitions[rep.downstream] for rep in plan.repartitions.values()}
    counts = _task_counts(saved, plan, partitions)
    old = _old_stages(saved, plan)
    clocks = {}
    for stage in plan.stages:
        for partition in range(stage_partitions[stage.index]):
            clock = _clock(
                saved, stage.index, old.get(stage.index), counts.get(stage.index), partition
            )
            if clock is not None:
                clocks[task_id_for(stage.index, partition)] = clock
    return clocks


StageRunner = Callable[[int, Iterable[tuple[Any, ...]]], Iterator[tuple[Any, ...]]]


def _stage_rdds(
    plan: Any,
    source: Any,
    pending: dict[int, list[Any]],
    stage_partitions: dict[int, int],
    runner: Callable[[int], StageRunner],
) -> dict[int, Any]:
    """Each stage's persisted RDD of its tasks' rows (``runner(k)``: ``run_stage_task`` of
    stage k), keyed by stage. ``source`` is stage 0's input by source partition; ``pending``
    the shuffled input each stage has before any stage runs (records in flight), and gets
    each stage's repartition output for the stage that reads it.

    A stage is built from the output of every stage writing its topics, so they are built in
    dataflow order (``StagePlan.in_dataflow_order``), not by number: union/connect can number
    a writer after its reader, whose Spark job then ran without the writer's records."""
    stage_rdds: dict[int, Any] = {}
    for stage in plan.in_dataflow_order():
        k = stage.index
        if k == 0:
            sorted_input = source.mapPartitions(
                lambda it: iter(sorted((v for _, v in it), key=lambda r: (r[1], r[0])))
            )
        else:
            feeds: list[Any] = pending.get(k, [])
            if not feeds:
                continue
            shuffled = feeds[0]
            for extra in feeds[1:]:
                shuffled = shuffled.union(extra)
            sorted_input = (
                shuffled.map(lambda r: (r[1], r))
                .partitionBy(stage_partitions[k], lambda p: p)
                .mapPartitions(
                    lambda it: iter(
                        (r[0], i, r[3], r[4], r[5])
                        for i, r in enumerate(sorted((v for _, v in it), key=lambda r: r[2]))
                    )
                )
            )
        result = sorted_input.mapPartitionsWithIndex(runner(k)).persist()
        stage_rdds[k] = result
        for rep in plan.repartitions.values():
            if rep.upstream == k:
                pending.setdefault(rep.downstream, []).append(
                    result.filter(_topic_is(rep.topic, 1)).map(
                        lambda r: (r[1], r[2], r[3], r[4], r[5], r[6])
                    )
                )
    return stage_rdds


def _topic_is(topic: str, column: int) -> Callable[[tuple[Any, ...]], bool]:
    """A row filter: shuffled records (or in-flight ones) of ``topic``."""

    def keep(row: tuple[Any, ...]) -> bool:
        if column == 1:
            return bool(row[0] == "shuffle" and row[1] == topic)
        return bool(row[0] == topic)

    return keep


def _stage_runner(
    config: RunConfig, stage: int
) -> Callable[[int, Iterable[tuple[Any, ...]]], Iterator[tuple[Any, ...]]]:
    def run(index: int, rows: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
        return run_stage_task(config, stage, index, rows)

    return run


def _target(key: bytes, plan: Any, topic: str, stage_partitions: dict[int, int], maxp: int) -> int:
    import zlib

    from snapline.pipeline.stages import repartition_partition

    downstream = next(r.downstream for r in plan.repartitions.values() if r.topic == topic)
    return repartition_partition(zlib.crc32(key[1:]) % maxp, stage_partitions[downstream], maxp)


def _run_range(
    storage: Any,
    job: str,
    run_id: str,
    starts: dict[tuple[str, int], int],
    ends: dict[tuple[str, int], int],
    say: Callable[[str], None],
    start: str = "",
) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
    """The source range of run ``run_id``: recorded (checksummed) before its first task, and
    read back when the run is run again with its id. A re-run with ``--to latest`` computed
    the end again; its tasks already committed re-published what they had staged over the old
    range while the savepoint claimed the new one, so the records in between were never output.

    ``start`` (the run's ``--from``) is recorded too. A run from a savepoint takes its state,
    clocks and records in flight from it: a re-run without that ``--from`` ran the recorded
    range from empty state and without those records (lost from the sinks and from the
    savepoint handed over), and one from a savepoint where the first run had none counted
    its state twice. Such a re-run is refused.

    ``start`` is recorded and compared redacted (``redact_text``): no credentials in storage,
    and the credentials a savepoint is read with are no part of which savepoint it is (a
    re-run with rotated keys runs from the same one). Earlier versions recorded it as given."""
    from snapline.pipeline.checkpoint.metadata import decode_checked, encode_checked

    path = f"{job}/spark/{run_id}/_range.json"
    if storage.exists(path):
        body = decode_checked(storage.read_bytes(path), storage.full_path(path))
        first = body.get("from")
        if first is not None:
            first = redact_text(first)
        if (
            first is not None
            and first != redact_text(start)
            and (first.startswith("savepoint:") or start.startswith("savepoint:"))
        ):
            raise ConfigurationError(
                f"run {run_id} was started with --from {first}, and is run again with --from "
                f"{redact_text(start) or '(none)'}: a run from a savepoint takes its state and "
                "records in flight from it, so run it again with the --from it started with "
                "(or under a new --run-id)"
            )
        recorded = (
            {(t, int(p)): int(o) for t, p, o in body["starts"]},
            {(t, int(p)): int(o) for t, p, o in body["ends"]},
        )
        if recorded != (starts, ends):
            say(f"run {run_id} again: over its recorded source range, not the one asked now")
        return recorded
    storage.write_bytes(
        path,
        encode_checked(
            {
                "starts": [[t, p, o] for (t, p), o in sorted(starts.items())],
                "ends": [[t, p, o] for (t, p), o in sorted(ends.items())],
                "transactional_ids": "job",  # _transactional_id, not _legacy_transactional_id
                "from": redact_text(start),  # no credentials in storage
            }
        ),
    )
    return starts, ends


def _check_range(
    consumer: Any, starts: dict[tuple[str, int], int], ends: dict[tuple[str, int], int]
) -> None:
    """Refuse a source range Kafka no longer holds in full. Spark's Kafka source skipped what
    is missing (``failOnDataLoss=false``): records below the log's start (retention,
    delete-records) were never output while the savepoint claimed the range; an end past the
    partition's end (a topic deleted and recreated, a ``--to`` beyond what was written) read
    what there was, and the services went on from the end the savepoint claimed."""
    from confluent_kafka import TopicPartition

    problems = []
    for (topic, p), end in sorted(ends.items()):
        start = starts[(topic, p)]
        if start >= end:
            if start > end:
                problems.append(f"{topic}[{p}]: the range [{start}, {end}) ends before it starts")
            continue
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
        except KafkaException as exc:
            problems.append(f"{topic}[{p}]: cannot read its offsets ({exc})")
            continue
        if start < low:
            problems.append(
                f"{topic}[{p}]: offsets [{start}, {min(low, end)}) were deleted "
                f"(the log starts at {low} now)"
            )
        if end > high:
            problems.append(
                f"{topic}[{p}]: offsets [{max(start, high)}, {end}) are not in Kafka "
                f"(the partition ends at {high}: deleted and recreated, or the end names "
                "offsets not written yet)"
            )
    if problems:
        raise ConfigurationError(
            "the source range of this run is not in Kafka in full, and Spark would skip what "
            "is missing: "
            + "; ".join(problems)
            + ". Nothing was run. Start a new run (another --run-id) whose --from and --to "
            "are within what the topics hold (their log start offsets are above), knowing "
            "that the records missing were never processed; if tasks of this run committed "
            "before, their output is in the sinks already, and a new run over their range "
            "writes it again"
        )


def _by_topic(offsets: dict[tuple[str, int], int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (topic, p), offset in offsets.items():
        out.setdefault(topic, {})[str(p)] = offset
    return out


def _by_topic_int(offsets: dict[tuple[str, int], int]) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for (topic, p), offset in offsets.items():
        out.setdefault(topic, {})[p] = offset
    return out
