"""Starting a job from a savepoint (``snapline run --from-savepoint URI``).

The savepoint is turned into the job's starting point once, before any worker processes:

1. its operators and states are matched to the pipeline's by operator uid and state name (a
   new state or operator starts empty; savepoint state with no place in the code is refused
   unless ``allow_non_restored``; a kind or serde mismatch is refused, naming the state);
2. every repartition topic is emptied (its records are deleted up to its end; its offsets go
   on) and given the partition count the code declares (its records in flight come from the
   savepoint, so a keyed stage can change its parallelism), and the in-flight records are
   produced into it, each to the partition of its key-group (``_empty_repartition_topic``).
   A topic with more partitions than the code declares (Kafka cannot remove any) is replaced
   by one of a new name, its next generation (``stages.repartition_topic``), and deleted: a
   repartition topic's name is never used again;
3. each task of the new layout gets a checkpoint in the normal format: a keyed-stage task takes
   exactly the entries of its key-group range, a source-stage task the entries of its
   partition; positions are the savepoint's source offsets (for repartition topics: where
   each partition starts after it was emptied). A source-stage task without offsets in the
   savepoint starts empty; state of its partition is refused like state without a place
   (``seeded_tasks``);
4. the consumer group's offsets are committed naming those checkpoints. Workers then start
   as after any restart: recovery restores the checkpoints the committed offsets name.

The job must be stopped (no member in its consumer group). Checkpoint ids continue above every
stored one, so sinks' fences and retention stay well defined.

Threads: the caller's (the CLI, before workers start); ``load_task`` runs in threads of it or
in pool processes (``pool``), one job per thread with a backend of its own.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import tempfile
import time
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import (
    AdminClient,
    ConfigResource,
    NewPartitions,
    NewTopic,
    OffsetSpec,
)

from snapline.connectors.config import redact_text
from snapline.pipeline.checkpoint.history import history_workers
from snapline.pipeline.checkpoint.metadata import (
    CheckpointRef,
    TaskCheckpoint,
    decode_checked,
    encode_checked,
    highest_checkpoint_id,
    mark_committed,
    raise_id_floor,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage, verify_checksum
from snapline.pipeline.errors import CheckpointError, ConfigurationError
from snapline.pipeline.graph import Pipeline
from snapline.pipeline.keygroups import key_group_range, operator_index_for_key_group
from snapline.pipeline.runtime import departed
from snapline.pipeline.runtime.faults import FaultInjector
from snapline.pipeline.runtime.kafka_calls import (
    BoundedCall,
    ErrorClass,
    KafkaClientError,
    classify,
    delete_records,
    is_unavailable,
    kafka_error,
)
from snapline.pipeline.runtime.topics import (
    DESCRIBE_TIMEOUT,
    INTERNAL_TOPIC_CONFIG,
    TopicManager,
    check_repartition_owners,
    cluster_id_of,
    describe_topic_ids,
    keep_internal_records,
    pipeline_topics,
    recreated_since,
    refused_config,
    without_event_time_config,
)
from snapline.pipeline.runtime.watermarks import decode_floors, encode_floors
from snapline.pipeline.savepoint.export import (
    JobTask,
    active_members,
    job_tasks,
    job_transaction_timeout,
    publish_committed_sinks,
    wait_until_stopped,
)
from snapline.pipeline.savepoint.format import METADATA_FILE as SAVEPOINT_METADATA
from snapline.pipeline.savepoint.format import (
    OperatorState,
    SavepointFile,
    SavepointMetadata,
    read_metadata,
    read_table,
)
from snapline.pipeline.savepoint.markers import (  # re-exported: restore's names
    RESTORED_FROM,
    RESTORING,
    check_no_interrupted_restore,  # noqa: F401  (re-exported)
    restore_group,
    use_topic_generations,
    write_topic_generations,
)
from snapline.pipeline.savepoint.pool import pool_size, run_jobs, scratch_options
from snapline.pipeline.stages import (
    SOURCE_STAGE,
    Repartition,
    repartition_partition,
    repartition_topic,
)
from snapline.pipeline.state import create_backend
from snapline.pipeline.state.backend import StateHandle
from snapline.pipeline.state.columns import build_stored_keys
from snapline.pipeline.state.compat import incompatibility
from snapline.pipeline.state.descriptors import StateDescriptor

log = logging.getLogger(__name__)

#: The columns of a data file a restore needs (the text columns are for other readers).
_RESTORED_COLUMNS = ["key_group", "key", "state", "map_key", "value"]


@dataclass(frozen=True)
class StateMapping:
    """Where one savepoint state goes: the new operator's node id and state id."""

    uid: str
    name: str
    node_id: int
    state_id: int


def match_states(
    pipeline: Pipeline, savepoint: SavepointMetadata, allow_non_restored: bool
) -> dict[tuple[str, str], StateMapping]:
    """Map (uid, state name) of the savepoint onto the pipeline; raises ConfigurationError
    naming every state that cannot be restored."""
    uids = pipeline.operator_uids()
    by_uid = {uid: node_id for node_id, uid in uids.items()}
    declared: dict[int, dict[str, tuple[int, StateDescriptor]]] = {
        node_id: {d.name or "": (sid, d) for sid, d in entries}
        for node_id, entries in pipeline.state_ids().items()
    }
    mapping: dict[tuple[str, str], StateMapping] = {}
    dropped: list[str] = []
    problems: list[str] = []
    for op in savepoint.operators:
        node_id = by_uid.get(op.uid)
        for state in op.states:
            where = f"state {state['name']!r} of operator {op.uid!r}"
            if node_id is None or state["name"] not in declared.get(node_id, {}):
                dropped.append(where)
                continue
            sid, desc = declared[node_id][state["name"]]
            problem = incompatibility(state, desc.describe(), where, "the savepoint")
            if problem is not None:
                problems.append(problem)
                continue
            mapping[(op.uid, state["name"])] = StateMapping(op.uid, state["name"], node_id, sid)
    if problems:
        raise ConfigurationError("cannot restore the savepoint: " + "; ".join(problems))
    if dropped and not allow_non_restored:
        raise ConfigurationError(
            f"the savepoint holds {', '.join(dropped)}, which the pipeline no longer declares "
            "(operators are matched by uid=, states by name). Restore with "
            "--allow-non-restored-state to drop that state on purpose, or give the operator "
            "its old uid="
        )
    for where in dropped:
        log.warning("dropping %s (--allow-non-restored-state)", where)
    return mapping


def _empty_repartition_topic(
    admin: AdminClient,
    topic: str,
    partitions: int,
    config: dict[str, str],
    check: Callable[[str], None] = lambda step: None,
) -> dict[int, int]:
    """Make ``topic`` an empty repartition topic of ``partitions`` partitions; returns where
    each partition starts now (its tasks' positions: the in-flight records go in from there).

    Offsets in a topic go on, never back: an existing topic keeps its offsets, its records are
    deleted up to its end (DeleteRecords) and it gains the partitions it lacks. A worker of the
    job before the restore, frozen past its session and woken after it (a zombie), may still
    delete the records below its old positions in this topic (DeleteRecords addresses topics
    by name; its topic id check and the delete are two steps): all of them lie below the
    restored job's records, so it deletes nothing the restored job reads. A topic with more
    partitions than the code declares was replaced by a topic of a new name before
    (``_replaced_topics``): deleting it and creating it again under its name started its
    offsets at 0 again, where such a delete removed records in flight the restored job had not
    read. A topic that does not exist (a new generation's) is created; one that appears
    meanwhile is kept like any other (``_create_topic`` never deletes).
    ``check(step)`` (the restore's guard) is asked before each change it makes."""
    metadata = admin.list_topics(timeout=30).topics.get(topic)
    if metadata is None:
        check(f"was about to create {topic}")
        if _create_topic(admin, topic, partitions, config):
            return dict.fromkeys(range(partitions), 0)
        # Created meanwhile (by whom is not known here): kept and emptied like any other.
        metadata = admin.list_topics(topic, timeout=30).topics.get(topic)
        if metadata is None or metadata.error is not None:
            raise CheckpointError(f"repartition topic {topic} exists and cannot be described")
    if len(metadata.partitions) > partitions:  # replaced before (_replaced_topics)
        raise CheckpointError(
            f"repartition topic {topic} has {len(metadata.partitions)} partitions and the code "
            f"declares {partitions}: it should have been replaced by a topic of a new name"
        )
    if len(metadata.partitions) < partitions:
        check(f"was about to add partitions to {topic}")
        try:
            admin.create_partitions([NewPartitions(topic, partitions)], operation_timeout=30)[
                topic
            ].result(timeout=35)
        except KafkaException as exc:
            # Added already (the metadata read above was stale)? Then that is done.
            try:
                now = admin.list_topics(topic, timeout=30).topics.get(topic)
            except KafkaException:
                now = None
            if now is None or len(now.partitions) != partitions:
                raise CheckpointError(
                    f"cannot give repartition topic {topic} {partitions} partitions: {exc}"
                ) from exc
        _wait_for_leaders(admin, topic, partitions, time.monotonic() + 60)
    starts: dict[int, int] = {}
    deadline = time.monotonic() + 60
    # Deleted up to the ends read now, not "to the end" whenever the request arrives: a
    # restore frozen after its guard's last check (a paused VM, SIGSTOP) and woken after
    # another restore finished deletes nothing the running job wrote since (those records
    # lie above these ends; offsets in a kept topic go on).
    ends = _high_watermarks(admin, topic, partitions, deadline)
    while len(starts) < partitions:
        # A partition just added, or one whose leader moved, answers "not leader" until the
        # admin client's metadata catches up: asked again, within a minute.
        retry: Exception | None = None
        check(f"was about to delete the records of {topic}")
        FaultInjector().point("restore_before_delete")
        try:
            deleted = delete_records(
                admin,
                [TopicPartition(topic, p, ends[p]) for p in range(partitions) if p not in starts],
                request_timeout=30,
                operation_timeout=30,
            )
        except KafkaException as exc:
            raise CheckpointError(f"cannot delete the records of {topic}: {exc}") from exc
        for tp, future in deleted.items():
            try:
                starts[tp.partition] = future.result(timeout=35).low_watermark
            except (KafkaException, FutureTimeout) as exc:
                # OFFSET_OUT_OF_RANGE: a new leader whose end still lags the one read (asked
                # again with the same ends: ends read again would reopen the window above).
                if not _transient(
                    exc, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.OFFSET_OUT_OF_RANGE
                ):
                    raise CheckpointError(
                        f"cannot delete the records of {topic} [{tp.partition}]: {exc}"
                    ) from exc
                retry = exc
        if retry is not None and time.monotonic() > deadline:
            raise CheckpointError(f"cannot delete the records of {topic}: {retry}")
        if retry is not None:
            time.sleep(0.5)
    log.info("emptied repartition topic %s (it now starts at %s)", topic, starts)
    return starts


def _transient(exc: Exception, *codes: int) -> bool:
    """``exc`` (a Kafka call's) is worth asking again: a timeout, a retriable or "broker
    unavailable" error, or one of ``codes``."""
    if isinstance(exc, FutureTimeout):
        return True
    error = kafka_error(exc)
    return error is not None and (
        error.retriable() or is_unavailable(error) or error.code() in codes
    )


def _transaction_timeout(pipeline: Pipeline) -> float:
    """The ``transaction.timeout.ms`` of the job's workers, in seconds (``export``)."""
    return job_transaction_timeout(pipeline)


def _high_watermarks(
    admin: AdminClient, topic: str, partitions: int, deadline: float
) -> dict[int, int]:
    """Each partition's end (high watermark) now; a transient error (a leader moving, a
    partition just added) is asked again until ``deadline``."""
    while True:
        try:
            found = admin.list_offsets(
                {TopicPartition(topic, p): OffsetSpec.latest() for p in range(partitions)},
                isolation_level=IsolationLevel.READ_UNCOMMITTED,
                request_timeout=30,
            )
            return {tp.partition: f.result(timeout=35).offset for tp, f in found.items()}
        except (KafkaException, FutureTimeout) as exc:
            transient = _transient(exc, KafkaError.UNKNOWN_TOPIC_OR_PART)
            if not transient or time.monotonic() > deadline:
                raise CheckpointError(f"cannot read the ends of {topic}: {exc}") from exc
            time.sleep(0.5)


#: Seconds a restore waits for a transaction left open in a repartition topic, beyond the
#: job's transaction.timeout.ms (after which Kafka aborts it).
OPEN_TRANSACTION_GRACE = 15.0


def _wait_for_open_transactions(
    admin: AdminClient,
    declared: dict[str, int],
    bound: float,
    abort_open: Callable[[], object] | None = None,
) -> None:
    """Until no transaction is open in the repartition topics a restore keeps (each of
    ``declared``'s topics that exists with at most the partitions the code declares),
    ``bound`` s at most. A worker killed in its epoch leaves its transaction open; emptying
    the topic does not end it, and read_committed readers (the restored stage's tasks) read
    nothing past its first record, the records in flight included, until Kafka aborts it,
    ``transaction.timeout.ms`` after it began (a worker with its transactional id would
    abort it at its start, but the restored job's workers may have other ids). A topic
    deleted and created again had none. Waited for here, before any change, not as a
    stalled stage after the restore.

    ``abort_open`` is called once when a transaction is found open (it aborts those of the
    job's known workers, ``_abort_workers_transactions``)."""
    metadata = admin.list_topics(timeout=30).topics
    kept = [
        TopicPartition(topic, p)
        for topic, count in declared.items()
        if topic in metadata and len(metadata[topic].partitions) <= count
        for p in metadata[topic].partitions
    ]
    if not kept:
        return
    deadline = time.monotonic() + bound
    told = False
    while True:
        try:
            ends = {}
            for level in (IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED):
                found = admin.list_offsets(
                    {tp: OffsetSpec.latest() for tp in kept},
                    isolation_level=level,
                    request_timeout=30,
                )
                ends[level] = {
                    (tp.topic, tp.partition): f.result(timeout=35).offset for tp, f in found.items()
                }
        except (KafkaException, FutureTimeout) as exc:
            # A leader moving (a broker restarting) answers for a while: asked again.
            if not _transient(exc) or time.monotonic() > deadline:
                raise CheckpointError(
                    f"cannot read the ends of the repartition topics: {exc}"
                ) from exc
            time.sleep(1.0)
            continue
        high, stable = ends[IsolationLevel.READ_UNCOMMITTED], ends[IsolationLevel.READ_COMMITTED]
        open_at = {tp: (stable[tp], high[tp]) for tp in high if stable[tp] < high[tp]}
        if not open_at:
            return
        where = ", ".join(f"{t}[{p}] at {s} of {h}" for (t, p), (s, h) in sorted(open_at.items()))
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"a transaction is still open in repartition topics after {bound:.0f} s ({where}):"
                " a worker of the job, killed or frozen, began it (one its checkpoint history does "
                "not name, whose transaction the restore could not abort, with a longer "
                "transaction.timeout.ms than the pipeline's kafka_config gives), or a producer "
                "outside the job writes there; nothing was changed. Restore again once Kafka "
                "has aborted it; a transaction Kafka no longer ends by itself (a hanging one) "
                "is found and aborted with kafka-transactions.sh find-hanging / abort"
            )
        if not told:
            log.info(
                "a transaction is open in repartition topics (a worker killed in its epoch): "
                "%s; waiting for it to end, at most %.0f s",
                where,
                bound,
            )
            told = True
            if abort_open is not None:
                abort_open()
                # The bound holds; the aborts' markers get a moment even if they took it all.
                deadline = max(deadline, time.monotonic() + 5.0)
                continue  # asked again at once: the aborts' markers are written
        time.sleep(1.0)


#: How far before its transaction's timeout a worker's newest history entry may be, and the
#: worker still hold an open transaction: the entry is written in the background after its
#: checkpoint (the next transaction began then), on a host whose clock may differ.
HISTORY_SLACK = 120.0


def _abort_workers_transactions(
    kafka_config: dict[str, Any],
    storage: CheckpointStorage,
    pipeline: Pipeline,
    admin: AdminClient,
    guard: _RestoreGuard,
) -> list[str]:
    """Abort the open transactions of the job's workers, as their restarts would
    (``init_transactions`` with each one's transactional id), instead of waiting
    ``transaction.timeout.ms`` for Kafka to abort them (a restore right after a crash).

    Which workers: those with an entry in the job's checkpoint history recent enough that a
    transaction of theirs can still be open (within the job's ``transaction.timeout.ms`` plus
    ``HISTORY_SLACK``). The restore's guard comes first: the job's group has no member, so
    each is dead or a zombie, which this fences (another restore finished, or the job runs:
    nothing is fenced). Skipped for a worker whose transactional id another job might share
    (its groups could not be described). Not done with
    ``SNAPLINE_ABORT_DEPARTED=0`` or for an at-least-once job. A worker killed before it left
    any history is not named: its transaction is waited for."""
    job = pipeline.name
    if not pipeline.exactly_once or not departed.enabled():
        return []
    guard.check(admin, "was about to abort the open transactions of the job's workers")
    since = time.time() - _transaction_timeout(pipeline) - HISTORY_SLACK
    try:
        gone = sorted(history_workers(storage, job, since=since))
    except Exception as exc:  # the history is best effort: then the wait is all there is
        log.warning("could not list the workers in the job's history: %s", exc)
        return []
    if not gone:
        return []
    # The guard found the group without members a moment ago. A worker that joins in
    # between is fenced as it starts: it replaces its producer and goes on (transaction.py),
    # and this restore's next check stops it.
    return departed.abort_transactions(
        kafka_config,
        job,
        gone,
        f"{job}-restore",
        lambda _: None,
        "of the stopped job, named in its checkpoint history",
        fence_if_unsure=False,
        parallel=8,
    )


def _generations_in_kafka(admin: AdminClient, pipeline: Pipeline) -> dict[str, int]:
    """``key_by`` name -> the highest generation of its repartition topic that exists in the
    cluster (``<job>.<name>.g<n>.repartition``), for the names that have one."""
    names = [rep.name for rep in pipeline.stages().repartitions.values()]
    if not names:
        return {}
    patterns = {
        name: re.compile(re.escape(f"{pipeline.name}.{name}.g") + r"([1-9][0-9]*)\.repartition")
        for name in names
    }
    found: dict[str, int] = {}
    for topic in admin.list_topics(timeout=30).topics:
        for name, pattern in patterns.items():
            match = pattern.fullmatch(topic)
            if match:
                found[name] = max(found.get(name, 0), int(match.group(1)))
    return found


def _replaced_topics(admin: AdminClient, plan: Any, partitions: dict[str, int]) -> list[str]:
    """The ``key_by`` names whose repartition topic has more partitions than the code
    declares: the restore replaces it by the next generation's topic."""
    if not plan.repartitions:
        return []
    existing = admin.list_topics(timeout=30).topics
    replaced = []
    for rep in plan.repartitions.values():
        metadata = existing.get(rep.topic)
        if metadata is not None and len(metadata.partitions) > partitions[rep.topic]:
            log.warning(
                "repartition topic %s has %d partitions and the code declares %d: it is "
                "replaced by a topic of a new name (Kafka cannot remove partitions, and a "
                "name is never used again)",
                rep.topic,
                len(metadata.partitions),
                partitions[rep.topic],
            )
            replaced.append(rep.name)
    return replaced


def _delete_replaced_topics(
    admin: AdminClient,
    job: str,
    rep: Repartition,
    generation: int,
    check: Callable[[str], None],
) -> None:
    """Delete the topics of ``rep``'s earlier generations that still exist: no worker of the
    job reads or writes them again (a worker starts with the job's generations, and they
    only go up). A worker of the job before the restore (a zombie) may still delete records
    in one, or write to it: nothing the restored job reads. A deletion that fails is logged
    (the next restore asks again)."""
    if generation == 0:
        return
    existing = admin.list_topics(timeout=30).topics
    old = [
        name
        for name in (repartition_topic(job, rep.name, g) for g in range(generation))
        if name in existing
    ]
    if not old:
        return
    check(f"was about to delete {', '.join(old)}")
    for topic, future in admin.delete_topics(old, operation_timeout=30).items():
        try:
            future.result(timeout=35)
            log.info("deleted repartition topic %s (replaced by %s)", topic, rep.topic)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                log.warning("could not delete replaced repartition topic %s: %s", topic, exc)


def _create_topic(admin: AdminClient, topic: str, partitions: int, config: dict[str, str]) -> bool:
    """Create ``topic`` with ``partitions`` (bounded waits); False if it exists already.

    Never deletes: a topic that exists may hold records a running job reads, and one created
    again under its name starts its offsets at 0, below a zombie's old positions."""
    while True:
        try:
            admin.create_topics(
                [NewTopic(topic, num_partitions=partitions, replication_factor=-1, config=config)],
                operation_timeout=30,
            )[topic].result(timeout=35)
            break
        except KafkaException as exc:
            if refused_config(exc) and config != without_event_time_config(config):
                config = without_event_time_config(config)  # a broker before 3.6
                continue
            if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                return False
            raise CheckpointError(f"cannot create topic {topic}: {exc}") from exc
    _wait_for_leaders(admin, topic, partitions, time.monotonic() + 60)
    return True


def _wait_for_leaders(admin: AdminClient, topic: str, partitions: int, deadline: float) -> None:
    """Until ``topic`` has ``partitions`` partitions, each with a leader (or ``deadline``)."""
    while True:
        topic_meta = admin.list_topics(topic, timeout=30).topics.get(topic)
        if (
            topic_meta is not None
            and topic_meta.error is None
            and len(topic_meta.partitions) == partitions
            and all(p.leader >= 0 for p in topic_meta.partitions.values())
        ):
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"topic {topic} has no leader for every partition")
        time.sleep(0.2)


def seed_from_savepoint(
    pipeline: Pipeline,
    kafka_config: dict[str, Any],
    checkpoint_dir: str,
    savepoint_uri: str,
    *,
    allow_non_restored: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    read_recreated_topics: bool = False,
) -> int | None:
    """Make ``savepoint_uri`` the job's starting point (see module). Returns the checkpoint
    id the tasks start from, or None when the job was already restored from this savepoint.
    ``progress(what, done, total)`` is told how many tasks' state is written.
    ``read_recreated_topics``: a source topic deleted and created again since the savepoint
    was taken is read from its start with the savepoint's state (else refused)."""
    # The records in flight are copied here, checksum verified, before Kafka is changed: once
    # the repartition topics are emptied, nothing may depend on the savepoint's storage.
    flight_dir = tempfile.mkdtemp(prefix="snapline-restore-in-flight-")
    # One restore of a job at a time: a worker on another host started with the same
    # --from-savepoint waits here, then finds the job restored (the marker) and goes on.
    lock = RestoreLock(kafka_config, pipeline.name)
    try:
        lock.acquire()
        return _seed(
            pipeline,
            kafka_config,
            checkpoint_dir,
            savepoint_uri,
            allow_non_restored,
            progress,
            CheckpointStorage(flight_dir),
            lock,
            read_recreated_topics,
        )
    except KafkaException as exc:
        # A check or change that Kafka refused or did not answer (a broker restarting): one
        # line, not a traceback. The RESTORING marker, once written, keeps workers out until
        # a restore completes; starting one again retries every step.
        raise CheckpointError(
            f"the restore of job {pipeline.name!r} from {redact_text(savepoint_uri)} stopped: "
            f"a Kafka request failed: {exc}; start it again (the same --from-savepoint) once "
            "the cluster answers"
        ) from exc
    finally:
        lock.release()
        shutil.rmtree(flight_dir, ignore_errors=True)


class _RestoreGuard:
    """Asked before each change a restore makes: is this restore still the job's only one?

    The lock is a lease (``RestoreLock``): a restore that stalls past its session (a paused
    VM, SIGSTOP) loses it without knowing, and its consumer may still show the assignment
    for a moment after it wakes. Meanwhile another restore can take the lock, finish, and
    the job's workers start and commit; the stalled one then emptied the repartition
    topics under them (committed records in flight lost, the savepoint's written
    back twice). So before each step that changes Kafka or the job's checkpoints it also
    asks what another restore leaves behind: the ``RESTORING`` marker it wrote is still there
    and still its own (another restore rewrites it with its token, a finished one deletes
    it), the job's ``RESTORED_FROM`` marker is as it was when this restore began (a finished
    restore rewrites it), and the job's group has no members (its workers run). Each answer
    is read right before the step, so only a stall between the two can slip through."""

    def __init__(self, storage: CheckpointStorage, job: str, lock: RestoreLock):
        self._storage = storage
        self._job = job
        self._lock = lock
        self._marker = f"{job}/{RESTORED_FROM}"
        self._restoring = f"{job}/{RESTORING}"
        self._marker_at_start = self._read(self._marker)
        self.token = uuid.uuid4().hex

    def _read(self, path: str) -> bytes | None:
        return self._storage.read_bytes(path) if self._storage.exists(path) else None

    def check(self, admin: Any, step: str, restoring: bool = False) -> None:
        """Raise CheckpointError naming ``step`` when another restore or the job went on;
        ``restoring``: this restore has written its ``RESTORING`` marker. The slow question
        (the group's members, a Kafka round trip) comes first, the storage reads last, so
        that they describe the moment right before the step."""
        members = active_members(admin, self._job)
        if members:
            self._stop(step, f"the job runs ({members} members in its consumer group)")
        self._lock.check()
        if self.superseded():
            self._stop(
                step,
                "another restore of the job finished meanwhile; the job goes on from what "
                "that restore seeded",
            )
        if restoring and self._token_now() != self.token:
            self._stop(step, "another restore of the job took over meanwhile and finishes it")

    def superseded(self) -> bool:
        """Another restore of the job finished since this one began (it rewrote the
        ``RESTORED_FROM`` marker)."""
        return self._read(self._marker) != self._marker_at_start

    def withdraw(self) -> None:
        """Delete this restore's ``RESTORING`` marker: once it completed, or when it was
        written after another restore had finished (``superseded``: this one changed nothing
        yet, and a marker left behind would refuse every worker's start, asking to restore
        again, a rewind to the savepoint). Only a marker with this restore's token: another's
        stays."""
        if self._token_now() == self.token:
            self._storage.delete_file(self._restoring)

    def _token_now(self) -> str | None:
        body = self._read(self._restoring)
        if body is None:
            return None
        try:
            return decode_checked(body, self._storage.full_path(self._restoring), "savepoint").get(
                "token"
            )
        except CheckpointError:
            return None

    def _stop(self, step: str, why: str) -> None:
        raise CheckpointError(
            f"the restore of job {self._job} {step}, but {why} (this restore stalled past "
            "its lock's session?): it stops before changing anything more"
        )


class RestoreLock:
    """Held by the member of consumer group ``<job>/restore`` that Kafka assigns the job's
    control partition: one restore of a job at a time, across hosts. Two restores at once
    both recreated the repartition topics and wrote the records in flight back, one after
    the other: twice, or the first one's deleted after its checkpoints named them.

    A holder that dies or freezes past ``SESSION_MS`` loses it to the next; ``check`` before
    each change to Kafka stops a woken one (a rebalance took the partition away)."""

    SESSION_MS = 10_000
    #: How often a waiting restore says what it waits for (seconds).
    SAY_EVERY = 30.0

    def __init__(self, kafka_config: dict[str, Any], job: str) -> None:
        self.job = job
        self._kafka_config = kafka_config
        self._config = {
            **kafka_config,
            "group.id": restore_group(job),
            "enable.auto.commit": False,
            "auto.offset.reset": "latest",
            "session.timeout.ms": self.SESSION_MS,
            # A restore loads state for minutes without polling; the membership is kept by
            # librdkafka's heartbeats meanwhile.
            "max.poll.interval.ms": 24 * 3600 * 1000,
            # The holder keeps the partition through a rebalance (another restore joining or
            # leaving the group): with eager assignment every member lost it for a moment, and
            # a CI run found both restores stopping on such moments (the woken one during the
            # rebalance the other's join began, the other during the one its leaving began),
            # the job left half-restored. A member dropped for a frozen session still loses it.
            "partition.assignment.strategy": "cooperative-sticky",
        }
        self._consumer: Consumer | None = None

    def acquire(self) -> None:
        """Wait until this process holds the lock (as long as another restore of the job
        runs; it says so every SAY_EVERY s)."""
        from snapline.pipeline.savepoint.control import control_topic, ensure_control_topic

        ensure_control_topic(self._kafka_config, self.job)
        self._consumer = Consumer(self._config)
        self._consumer.subscribe([control_topic(self.job)])
        started = said = time.monotonic()
        while not self._held():
            if time.monotonic() - said >= self.SAY_EVERY:
                said = time.monotonic()
                log.info(
                    "waiting %.0f s for the restore of job %s that another process runs",
                    said - started,
                    self.job,
                )

    def _held(self) -> bool:
        assert self._consumer is not None
        self._consumer.poll(0.2)  # serves the group's rebalance callbacks
        return bool(self._consumer.assignment())

    def check(self) -> None:
        """Raise CheckpointError when the lock was lost (this process froze past its session
        and another restore took over)."""
        if self._consumer is not None and not self._held():
            raise CheckpointError(
                f"the restore of job {self.job} lost its lock (stalled longer than "
                f"{self.SESSION_MS / 1000:.0f} s?) to another restore; it stops before "
                "changing anything more"
            )

    def release(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            try:
                consumer.close()  # leaves the group: a waiting restore takes over at once
            except KafkaException as exc:
                log.warning("restore lock: %s", exc)


def _seed(
    pipeline: Pipeline,
    kafka_config: dict[str, Any],
    checkpoint_dir: str,
    savepoint_uri: str,
    allow_non_restored: bool,
    progress: Callable[[str, int, int], None] | None,
    flight_copies: CheckpointStorage,
    lock: RestoreLock,
    read_recreated_topics: bool,
) -> int | None:
    where = str(kafka_config.get("bootstrap.servers"))
    pipeline.validate()
    sp_storage = CheckpointStorage(savepoint_uri)
    # Gone (deleted once the job was restored from it) is no reason to refuse a worker still
    # started with --from-savepoint, when the job's marker says it was restored from it.
    savepoint = read_metadata(sp_storage) if sp_storage.exists(SAVEPOINT_METADATA) else None
    storage = CheckpointStorage(checkpoint_dir)
    use_topic_generations(pipeline, storage)  # the topics the job uses now
    marker = f"{pipeline.name}/{RESTORED_FROM}"
    guard = _RestoreGuard(storage, pipeline.name, lock)
    # A restore that died after changing Kafka is finished by any restore, also one of the
    # savepoint the job was restored from before (the marker names that one).
    if storage.exists(marker) and not storage.exists(f"{pipeline.name}/{RESTORING}"):
        # With a checksum: a changed byte must not make the job look not yet restored (it
        # would be seeded again, its offsets reset to the savepoint's).
        what = storage.full_path(marker)
        previous = decode_checked(storage.read_bytes(marker), what, "savepoint")
        # Written redacted (earlier versions: as given, credentials included).
        if previous.get("savepoint") in (savepoint_uri, redact_text(savepoint_uri)) and (
            savepoint is None or previous.get("created_at") == savepoint.created_at
        ):
            log.info(
                "the job was already restored from %s (checkpoint %s)%s; continuing from its "
                "committed checkpoints",
                savepoint_uri,
                previous.get("checkpoint"),
                " and the savepoint is gone since" if savepoint is None else "",
            )
            return None
    if savepoint is None:
        savepoint = read_metadata(sp_storage)  # raises: not a complete savepoint
    # Never back to a name the job used before: the savepoint's generations count too (a
    # restore into another checkpoint storage has none stored).
    stored_generations = dict(pipeline.topic_generations)
    pipeline.topic_generations = {
        name: max(stored_generations.get(name, 0), savepoint.topic_generations.get(name, 0))
        for name in {*stored_generations, *savepoint.topic_generations}
    }
    if savepoint.max_parallelism != pipeline.max_parallelism:
        raise ConfigurationError(
            f"the savepoint has max_parallelism={savepoint.max_parallelism}, the pipeline "
            f"{pipeline.max_parallelism}; key-groups cannot be remapped: keep "
            f"max_parallelism={savepoint.max_parallelism}"
        )
    mapping = match_states(pipeline, savepoint, allow_non_restored)
    admin = AdminClient(kafka_config)
    members = wait_until_stopped(admin, pipeline.name)
    if members:
        raise ConfigurationError(
            f"the job {pipeline.name!r} is running ({members} members in its consumer group); "
            "stop it before restoring a savepoint (snapline savepoint create --stop does both)"
        )
    # Nor back below a generation whose topic exists (a savepoint taken before a replacement,
    # restored into another checkpoint storage on the same cluster).
    for name, generation in _generations_in_kafka(admin, pipeline).items():
        if generation > pipeline.topic_generations.get(name, 0):
            pipeline.topic_generations = {**pipeline.topic_generations, name: generation}
    check_repartition_owners(kafka_config, pipeline)  # it empties them
    plan = pipeline.stages()
    topic_plan = TopicManager(kafka_config, where).ensure(
        [
            s
            for s in pipeline_topics(pipeline)
            if s.name not in {r.topic for r in plan.repartitions.values()}
        ]
    )
    topic_ids = _source_topic_ids(admin, pipeline, savepoint, savepoint_uri, read_recreated_topics)
    for topic in pipeline.source_topics():
        before = savepoint.source_partitions.get(topic)
        if before is not None and before != topic_plan.partitions[topic]:
            raise ConfigurationError(
                f"source topic {topic} had {before} partitions when the savepoint was taken "
                f"and has {topic_plan.partitions[topic]} now; the source stage's state and "
                "offsets are per partition and cannot move"
            )
    default = max((topic_plan.partitions[t] for t in pipeline.source_topics()), default=1)

    def declared(plan: Any) -> dict[str, int]:
        partitions = {t: topic_plan.partitions[t] for t in pipeline.source_topics()}
        for rep in plan.repartitions.values():
            # As the workers create it (topics.plan): the sources' count, at most one
            # partition per key-group.
            partitions[rep.topic] = rep.partitions or min(default, pipeline.max_parallelism)
        return partitions

    partitions = declared(plan)
    # A repartition topic with more partitions than the code declares (Kafka cannot remove
    # any) is replaced by its next generation's, a name never used before
    # (stages.repartition_topic); the generations are written before Kafka is changed.
    replaced = _replaced_topics(admin, plan, partitions)
    if replaced:
        pipeline.topic_generations = {
            **pipeline.topic_generations,
            **{name: pipeline.topic_generations.get(name, 0) + 1 for name in replaced},
        }
        plan = pipeline.stages()
        partitions = declared(plan)
    # Every check (names, checksums, state placement and loading) comes before the first
    # change to Kafka: a refused restore must leave the job's repartition topics, which its
    # committed checkpoints read from, as they were.
    flights = _read_in_flight(pipeline, sp_storage, savepoint, flight_copies)

    # Checkpoint id: above every one the job used, here and where the savepoint was taken (a
    # restore into another checkpoint storage must not start again at 1: the PostgreSQL
    # sink's upsert keeps the rows a task wrote at higher ids, silently).
    checkpoint_id = (
        max(highest_checkpoint_id(storage, pipeline.name), savepoint.highest_checkpoint_id) + 1
    )
    ref = CheckpointRef(checkpoint_id, uuid.uuid4().hex[:8])
    uids = pipeline.operator_uids()
    stage_of_node = {node_id: stage.index for stage in plan.stages for node_id in stage.node_ids}
    states_meta = [
        {**desc.describe(), "id": sid, "operator": node_id, "uid": uids[node_id]}
        for node_id, entries in pipeline.state_ids().items()
        for sid, desc in entries
    ]
    operators = {op.uid: op for op in savepoint.operators}
    restored_uids = {m.uid for m in mapping.values()}
    for uid in restored_uids:
        node_id = next(m.node_id for m in mapping.values() if m.uid == uid)
        if operators[uid].partitioning == "keyed" and stage_of_node[node_id] == SOURCE_STAGE:
            raise ConfigurationError(
                f"operator {uid!r} was in a keyed stage (after key_by(fn)) and is now in the "
                "source stage, whose tasks follow the source partitioning; its state cannot "
                "be placed: keep the re-keying key_by before it"
            )
    scratch = tempfile.mkdtemp(prefix="snapline-restore-")
    offsets: list[TopicPartition] = []
    try:
        chosen = seeded_tasks(pipeline, savepoint, mapping, partitions, allow_non_restored)
        jobs: list[LoadJob] = []
        for task, _ in chosen:
            jobs.append(
                LoadJob(
                    backend=pipeline.state_backend,
                    backend_options=dict(pipeline.state_backend_options),
                    scratch=f"{scratch}/{task.task_id}",
                    savepoint_uri=savepoint_uri,
                    operators=[
                        operators[uid]
                        for uid in sorted(restored_uids)
                        if stage_of_node[next(m.node_id for m in mapping.values() if m.uid == uid)]
                        == task.stage
                    ],
                    mapping=mapping,
                    partition=task.partition,
                    partitions=partitions,
                    reads=plan.stages[task.stage].reads,
                    max_parallelism=pipeline.max_parallelism,
                    checkpoint_dir=checkpoint_dir,
                    directory=ref.directory(pipeline.name, task.task_id),
                    checkpoint_id=checkpoint_id,
                )
            )

        def tell(done: int, total: int) -> None:
            if progress is not None:
                progress("restoring savepoint state", done, total)

        counts = _task_counts(savepoint, plan, partitions)
        old_stages = _old_stages(savepoint, plan)
        tell(0, len(jobs))
        rows = sum(f.rows for op in savepoint.operators for f in op.files)
        loaded = run_jobs(load_task, jobs, pool_size(len(jobs), rows=rows), tell)
        # Loading can take minutes: a worker started meanwhile would have its topics deleted
        # under it and keep the group from being reset. Asked again before Kafka changes.
        members = wait_until_stopped(admin, pipeline.name)
        if members:
            raise ConfigurationError(
                f"the job {pipeline.name!r} started while its savepoint was being restored "
                f"({members} members in its consumer group); stop it and restore again"
            )
        # Before anything else that changes Kafka: an earlier restore of the job frozen with
        # its write-back's transaction open can then neither commit it nor hold the topics.
        producer = _restore_producer(kafka_config, pipeline, admin, guard)
        _wait_for_open_transactions(
            admin,
            {rep.topic: partitions[rep.topic] for rep in plan.repartitions.values()},
            _transaction_timeout(pipeline) + OPEN_TRANSACTION_GRACE,
            lambda: _abort_workers_transactions(kafka_config, storage, pipeline, admin, guard),
        )
        # A kept repartition topic that compacts would refuse the DeleteRecords that empty
        # it, and drop records between stages: set to delete, or refused, before any change.
        existing = admin.list_topics(timeout=30).topics
        keep_internal_records(
            admin,
            sorted(r.topic for r in plan.repartitions.values() if r.topic in existing),
            DESCRIBE_TIMEOUT,
        )
        FaultInjector().point("restore_before_kafka_changes")
        guard.check(admin, "was about to change Kafka")
        FaultInjector().point("restore_before_marker")
        storage.write_bytes(
            f"{pipeline.name}/{RESTORING}",
            encode_checked(
                {
                    "savepoint": redact_text(savepoint_uri),
                    "created_at": savepoint.created_at,
                    "started_at": time.time(),
                    "token": guard.token,
                }
            ),
        )
        try:  # a stall between the check and the write: the marker must not be left behind
            guard.check(admin, "wrote its marker", restoring=True)
        except CheckpointError:
            if guard.superseded():
                guard.withdraw()
            raise
        publish_committed_sinks(pipeline, storage, admin)
        # Every worker's ids go on above the seeded checkpoint, also one whose tasks have
        # nothing seeded (source partitions without offsets in the savepoint).
        raise_id_floor(storage, pipeline.name, checkpoint_id)
        if pipeline.topic_generations != stored_generations:
            # Under the marker: a restore that dies from here on is finished by the next,
            # which reads these generations and keeps the topics this one created.
            write_topic_generations(storage, pipeline.name, pipeline.topic_generations)
        FaultInjector().point("restore_before_topics")
        starts: dict[tuple[str, int], int] = {}
        for rep in plan.repartitions.values():
            guard.check(admin, f"was about to empty {rep.topic}", restoring=True)
            emptied = _empty_repartition_topic(
                admin,
                rep.topic,
                partitions[rep.topic],
                INTERNAL_TOPIC_CONFIG,
                lambda step: guard.check(admin, step, restoring=True),
            )
            starts.update(((rep.topic, p), o) for p, o in emptied.items())
            _delete_replaced_topics(
                admin,
                pipeline.name,
                rep,
                pipeline.topic_generations.get(rep.name, 0),
                lambda step: guard.check(admin, step, restoring=True),
            )
        guard.check(admin, "was about to write the records in flight back", restoring=True)
        # One transaction of the restore's producer carries the records in flight and the
        # job's offsets: a restore frozen before its commit and woken after another restore
        # began (whose init_transactions fenced it) commits neither (_reset_offsets).
        with _restore_transaction(producer, pipeline):
            _produce_in_flight(pipeline, producer, flight_copies, flights, partitions)
            guard.check(admin, "was about to write the seeded checkpoints", restoring=True)
            for (task, seeded), (handle, _) in zip(chosen, loaded, strict=True):
                # A repartition partition's task starts where the emptied partition starts.
                positions = {tp: starts.get(tp, o) for tp, o in seeded.items()}
                TaskCheckpoint(
                    job=pipeline.name,
                    task_id=task.task_id,
                    ref=ref,
                    worker_id=departed.SEEDED,
                    positions=positions,
                    state=handle,
                    states=states_meta,
                    created_at=time.time(),
                    time=_clock(
                        savepoint,
                        task.stage,
                        old_stages.get(task.stage),
                        counts.get(task.stage),
                        task.partition,
                    ),
                    task_count=(
                        None
                        if task.stage == SOURCE_STAGE
                        else partitions[plan.stages[task.stage].reads[0]]
                    ),
                    topic_ids={t: topic_ids[t] for t, _ in positions if t in topic_ids},
                ).write(storage)
                mark_committed(storage, pipeline.name, task.task_id, ref)
                offsets += [
                    TopicPartition(t, p, o, metadata=ref.offset_metadata())
                    for (t, p), o in positions.items()
                ]
            _reset_offsets(
                admin,
                kafka_config,
                pipeline,
                producer,
                offsets,
                lambda step: guard.check(admin, step, restoring=True),
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # A restore frozen after its commit, woken once another had begun, must not mark the job
    # restored under that one (its topics emptied since) nor delete its RESTORING marker.
    guard.check(admin, "was about to mark the job restored", restoring=True)
    storage.write_bytes(
        marker,
        encode_checked(
            {
                "savepoint": redact_text(savepoint_uri),  # no credentials in storage
                "created_at": savepoint.created_at,
                "checkpoint": checkpoint_id,
                "restored_at": time.time(),
            }
        ),
    )
    guard.withdraw()  # its own RESTORING marker, after the marker: complete
    log.info(
        "restored job %s from savepoint %s: checkpoint %d for %d partitions",
        pipeline.name,
        savepoint_uri,
        checkpoint_id,
        len(offsets),
    )
    return checkpoint_id


def seeded_tasks(
    pipeline: Pipeline,
    savepoint: SavepointMetadata,
    mapping: dict[tuple[str, str], StateMapping],
    partitions: dict[str, int],
    allow_non_restored: bool,
) -> list[tuple[JobTask, dict[tuple[str, int], int]]]:
    """The tasks of the new layout that get a seeded checkpoint, each with its positions: a
    keyed-stage task at the start of its repartition partitions (0 here: where the emptied
    topic starts is known later), a source-stage task at the savepoint's offsets of its
    partitions. A source-stage task the savepoint has no offset for starts like a new task,
    at the source's starting position, with empty state.

    The source stage's state is per source partition (``operators/<uid>/p00002.parquet`` is
    task 2's), and a task is restored from the checkpoint its committed offsets name, so
    state goes only to a task that has offsets. State of the savepoint that no seeded task
    takes (its source topics renamed, e.g. by a MirrorMaker 2 migration, or fewer source
    partitions now) is refused like any other state without a place, naming it, unless
    ``allow_non_restored`` drops it (logged). It is not restored with offsets guessed: the
    savepoint's offsets are of its topics, and where its state's input ends in another topic
    the restore cannot know (its start repeats records the state holds, its end skips
    records the state never saw)."""
    tasks = job_tasks(pipeline, partitions)
    chosen: list[tuple[JobTask, dict[tuple[str, int], int]]] = []
    for task in tasks:
        positions = {
            (t, p): (
                savepoint.source_offsets.get(t, {}).get(p, -1) if task.stage == SOURCE_STAGE else 0
            )
            for t, p in task.inputs
        }
        positions = {tp: o for tp, o in positions.items() if o >= 0}
        if positions:
            chosen.append((task, positions))
    seeded = {task.partition for task, _ in chosen if task.stage == SOURCE_STAGE}
    stage_of_node = {
        node_id: stage.index for stage in pipeline.stages().stages for node_id in stage.node_ids
    }
    unplaced: list[str] = []
    for op in savepoint.operators:
        states = sorted(name for uid, name in mapping if uid == op.uid)
        nodes = {m.node_id for m in mapping.values() if m.uid == op.uid}
        if not states or any(stage_of_node[n] != SOURCE_STAGE for n in nodes):
            continue  # nothing restored, or a keyed stage's (every one of its tasks is seeded)
        lost = sorted(
            {
                f.partition
                for f in op.files
                if f.key_groups is None and f.rows and f.partition not in seeded
            }
        )
        if lost:
            unplaced.append(
                f"states {', '.join(map(repr, states))} of operator {op.uid!r} for source "
                f"partitions {', '.join(map(str, lost))}"
            )
    if not unplaced:
        return chosen
    if allow_non_restored:
        for where in unplaced:
            log.warning(
                "dropping source-stage %s: the savepoint has no offsets of them for the "
                "topics read now (--allow-non-restored-state)",
                where,
            )
        return chosen
    then = sorted(t for t, offsets in savepoint.source_offsets.items() if offsets)
    now = sorted(pipeline.source_topics())
    raise ConfigurationError(
        f"the savepoint holds source-stage {'; '.join(unplaced)}, and no offsets for those "
        f"partitions of the topics the source stage reads now ({', '.join(now)}): its offsets "
        f"are of {', '.join(then) or 'no topic'}. Source-stage state is per partition of the "
        "topics it was read from, and where its input ends in other topics (renamed or "
        "mirrored) the restore cannot know: the state would be dropped. Restore with "
        "--allow-non-restored-state to drop it on purpose (those tasks start empty at the "
        "source's starting position), or with the source topics the savepoint was taken from"
    )


def _source_topic_ids(
    admin: Any,
    pipeline: Pipeline,
    savepoint: SavepointMetadata,
    savepoint_uri: str,
    read_recreated_topics: bool,
) -> dict[str, str]:
    """The ids the seeded checkpoints record for the source topics: the ones the savepoint's
    offsets were read in, else (savepoints of earlier versions) the topics' ids now. A topic
    deleted and created again since the savepoint was taken is refused here, before Kafka is
    changed: the savepoint's offsets are offsets of the old topic, and going on from them
    would skip or repeat the new topic's records. ``read_recreated_topics`` lets it through;
    the worker then reads it from its start (its restore meets the old id in the seeded
    checkpoint: an ERROR line and a ``source_topic_recreated`` event per task)."""
    sources = pipeline.source_topics()
    now = describe_topic_ids(admin, sources, "source topics")
    here = cluster_id_of(admin)
    saved = {t: i for t, i in savepoint.topic_ids_on(here).items() if t in sources}
    if here and savepoint.cluster_id not in ("", here):
        log.info(
            "the savepoint was taken on Kafka cluster %s, this is %s: topic ids are per "
            "cluster and are not compared",
            savepoint.cluster_id,
            here,
        )
    recreated = recreated_since(saved, now)
    if recreated:
        names = ", ".join(f"{t} (id {saved[t]}, now {now[t]})" for t in recreated)
        if not read_recreated_topics:
            raise ConfigurationError(
                f"source topics {names} were deleted and created again since the savepoint "
                f"{redact_text(savepoint_uri)} was taken: its offsets are offsets of the old "
                "topics, and going on from them would skip or repeat records of the new ones. "
                "The restore stopped before changing the job's offsets and repartition topics. "
                "Add --read-recreated-topics to read them from their start with the "
                "savepoint's state"
            )
        log.error(
            "source topics %s were created again since the savepoint was taken: the job "
            "reads them from their start with the savepoint's state (--read-recreated-topics)",
            names,
        )
    return {**{t: i for t, i in now.items() if i}, **saved}


def _old_stages(savepoint: SavepointMetadata, plan: Any) -> dict[int, int]:
    """Each stage's number when the savepoint was taken: the stage that read the same
    ``key_by``s (by name), else one that read any of them; a stage the savepoint had no
    counterpart of is left out. Savepoints of earlier versions did not record what their
    stages read: their numbers are taken as they are."""
    if not savepoint.stage_reads:
        return {stage.index: stage.index for stage in plan.stages}
    names = {rep.topic: rep.name for rep in plan.repartitions.values()}
    old = {index: set(reads) for index, reads in savepoint.stage_reads.items() if reads}
    out = {SOURCE_STAGE: SOURCE_STAGE}
    for stage in plan.stages:
        if stage.index == SOURCE_STAGE:
            continue
        reads = {names.get(topic, topic) for topic in stage.reads}
        same = [index for index, was in old.items() if was == reads]
        overlapping = [index for index, was in old.items() if was & reads]
        if same or overlapping:
            out[stage.index] = min(same or overlapping)
    return out


def _clock(
    savepoint: SavepointMetadata,
    stage: int,
    old_stage: int | None,
    counts: tuple[int, int] | None = None,
    partition: int = 0,
) -> dict[str, Any] | None:
    """The clock of task ``partition`` of ``stage`` (``old_stage``: the same stage's number
    in the savepoint; None: a stage new in the code).

    Its own from the savepoint when the task existed there with the same key-groups.
    ``counts``: (task count in the savepoint, task count now) of a keyed stage; when they
    differ, task ids name other key-groups, and the task's clock is the smallest watermark of
    the old tasks whose key-groups it takes (their records in flight are replayed to it, so a
    larger watermark would make them late); the key-groups of the old tasks that were further
    keep their watermark as a floor (runtime/watermarks.py), so that their windows that fired
    or were purged do not open again. Otherwise (a task the savepoint has no clock for)
    the smallest watermark of the stage's saved tasks, so event time never moves back past
    what every task had reached.

    A keyed stage's clock keeps only its watermark, not the watermarks its channels had from
    each upstream task: an upstream stage restored with another task count has tasks of the
    same ids over other key-groups, and their old watermarks would run ahead of what the new
    ones send (the channels wait for every writer's first watermark after the restore)."""
    if old_stage is None:
        # A stage new in the code: the smallest watermark of the savepoint's keyed stages, so
        # event time does not start over for records that were late there.
        marks = [int(c.get("watermark", 0)) for t, c in savepoint.clocks.items() if t[:1] == "s"]
        return {"watermark": min(marks), "channels": []} if marks else None
    prefix = "p" if old_stage == SOURCE_STAGE else f"s{old_stage}-p"
    if counts is not None and stage != SOURCE_STAGE and counts[0] != counts[1]:
        old, new = counts
        # Each key-group's event time: its old task's watermark (or floor).
        groups: dict[int, int] = {}
        owners: dict[int, tuple[int, dict[int, int]] | None] = {}
        for group in key_group_range(partition, new, savepoint.max_parallelism):
            owner = operator_index_for_key_group(group, old, savepoint.max_parallelism)
            if owner not in owners:  # each old clock's floors decoded once
                clock = savepoint.clocks.get(f"{prefix}{owner}")
                owners[owner] = (
                    None
                    if clock is None
                    else (int(clock.get("watermark", 0)), decode_floors(clock.get("floors", [])))
                )
            known = owners[owner]
            if known is not None:
                mark, floors = known
                groups[group] = max(mark, floors.get(group, mark))
        if groups:
            low = min(groups.values())
            floors = {g: mark for g, mark in groups.items() if mark > low}
            if floors:
                return {"watermark": low, "channels": [], "floors": encode_floors(floors)}
            return {"watermark": low, "channels": []}
    elif f"{prefix}{partition}" in savepoint.clocks:
        clock = savepoint.clocks[f"{prefix}{partition}"]
        if stage == SOURCE_STAGE:
            return clock
        kept = {"watermark": int(clock.get("watermark", 0)), "channels": []}
        if clock.get("floors"):
            kept["floors"] = clock["floors"]
        return kept
    marks = [
        int(clock.get("watermark", 0))
        for saved, clock in savepoint.clocks.items()
        if saved.startswith(prefix) and (old_stage != SOURCE_STAGE or saved[1:].isdigit())
    ]
    return {"watermark": min(marks), "channels": []} if marks else None


def _task_counts(
    savepoint: SavepointMetadata, plan: Any, partitions: dict[str, int]
) -> dict[int, tuple[int, int]]:
    """Each keyed stage's (task count when the savepoint was taken, task count now): the
    partitions its repartition topic had then and has now. Matched by the ``key_by``'s name,
    as the records in flight are: a topic's name starts with its job's, and a savepoint
    restored under another job name found no count, so each new task took the watermark of
    the old task of its number instead of the owners of its key-groups."""
    then = {f.name: f.partitions for f in savepoint.in_flight}
    return {
        rep.downstream: (then[rep.name], partitions[rep.topic])
        for rep in plan.repartitions.values()
        if rep.name in then
    }


@dataclass(frozen=True)
class LoadJob:
    """One new task's state from a savepoint, for ``load_task`` in any process."""

    backend: str
    backend_options: dict[str, Any]
    #: A local directory of its own for the task's backend.
    scratch: str
    savepoint_uri: str
    #: The savepoint operators whose state belongs to the task's stage.
    operators: list[OperatorState]
    mapping: dict[tuple[str, str], StateMapping]
    partition: int
    partitions: dict[str, int]
    reads: tuple[str, ...]
    max_parallelism: int
    checkpoint_dir: str
    #: Where in checkpoint storage the task's state goes (its checkpoint's directory).
    directory: str
    checkpoint_id: int


def load_task(job: LoadJob) -> tuple[StateHandle, int]:
    """Load the task's entries of every operator into a new backend and materialize it as a
    checkpoint's state; returns its handle and how many entries it holds (a module-level
    function: pool processes run it)."""
    backend = create_backend(
        job.backend, task_dir=job.scratch, options=scratch_options(job.backend, job.backend_options)
    )
    sp_storage = CheckpointStorage(job.savepoint_uri)
    try:
        entries = 0
        for operator in job.operators:
            entries += _load_operator(
                backend,
                sp_storage,
                operator,
                job.mapping,
                job.partition,
                job.partitions,
                job.reads,
                job.max_parallelism,
            )
        snapshot = backend.snapshot(job.checkpoint_id)
        try:
            handle = snapshot.materialize(CheckpointStorage(job.checkpoint_dir), job.directory)
        finally:
            snapshot.release()
    finally:
        backend.close()
        shutil.rmtree(job.scratch, ignore_errors=True)
    return handle, entries


def _load_operator(
    backend: Any,
    sp_storage: CheckpointStorage,
    operator: OperatorState,
    mapping: dict[tuple[str, str], StateMapping],
    partition: int,
    partitions: dict[str, int],
    reads: tuple[str, ...],
    max_parallelism: int,
) -> int:
    """Put the operator's entries that belong to task ``partition`` into ``backend``;
    returns how many."""
    if reads:  # a keyed stage: the task owns a key-group range
        groups = key_group_range(partition, partitions[reads[0]], max_parallelism)
        lo, hi = groups.start, groups.stop - 1
        chosen = [
            f
            for f in operator.files
            if f.key_groups is None or (f.key_groups[0] <= hi and f.key_groups[1] >= lo)
        ]
    else:
        lo, hi = 0, max_parallelism - 1
        chosen = [f for f in operator.files if f.partition == partition]
    sids = {name: m.state_id for (uid, name), m in mapping.items() if uid == operator.uid}
    names = pa.array(list(sids), pa.string())
    ids = np.array(list(sids.values()), dtype=np.uint8)
    loaded = 0
    for entry in chosen:
        table = read_table(
            sp_storage, entry, columns=_RESTORED_COLUMNS, key_groups=(lo, hi) if reads else None
        )
        # Rows of states dropped on purpose (--allow-non-restored-state) find no index.
        index = pc.index_in(table.column("state"), value_set=names)
        if index.null_count:
            table = table.filter(pc.is_valid(index))
            index = pc.drop_null(index)
        if not table.num_rows:
            continue
        state_ids = ids[np.asarray(index.to_numpy(zero_copy_only=False), dtype=np.int64)]
        stored = build_stored_keys(
            table.column("key_group").combine_chunks(),
            table.column("key").combine_chunks(),
            state_ids,
            table.column("map_key").combine_chunks(),
        )
        backend.load_arrays(stored, table.column("value").combine_chunks())
        loaded += len(stored)
    return loaded


def _read_in_flight(
    pipeline: Pipeline,
    sp_storage: CheckpointStorage,
    savepoint: SavepointMetadata,
    copies: CheckpointStorage,
) -> list[tuple[Repartition, SavepointFile]]:
    """The savepoint's files of records in flight with the repartition each goes back into,
    each read and checksummed before anything is changed and copied into ``copies`` (local
    disk), which the produce reads: in-flight records can be many, so they are not held in
    memory, and once Kafka is changed a failing savepoint storage must not stop the restore
    halfway (the repartition topics emptied). Records in flight in a repartition
    the pipeline no longer has are refused; an empty one is nothing to place."""
    by_name = {rep.name: rep for rep in pipeline.stages().repartitions.values()}
    flights = []
    for flight in savepoint.in_flight:
        rep = by_name.get(flight.name)
        rows = sum(entry.rows for entry in flight.files)
        if rep is None:
            if rows == 0:
                continue
            raise ConfigurationError(
                f"the savepoint has {rows} records in flight in repartition {flight.name!r}, "
                "which the pipeline no longer has; keep key_by(name="
                f"{flight.name!r}) for this restore, or take the savepoint again once nothing "
                "is in flight (stop the sources' producers, let the job drain, then "
                "snapline savepoint create --stop)"
            )
        for entry in flight.files:
            data = sp_storage.read_bytes(entry.path)
            verify_checksum(
                data, entry.checksum, f"savepoint file {sp_storage.full_path(entry.path)}"
            )
            copies.write_bytes(entry.path, data)
            read_table(copies, entry, columns=["partition"])  # a Parquet file, whole
            flights.append((rep, entry))
    return flights


def restore_transactional_id(job: str) -> str:
    """The transactional id of the producer with which a restore of ``job`` writes the records
    in flight back: one per job, so each restore's ``init_transactions`` fences the restores
    of the job before it (a '/' no worker's id has; the ``snapline-<job>`` prefix the workers'
    ids have)."""
    return f"snapline-{job}/restore"


#: The restore's transaction may last this long (the broker's default
#: ``transaction.max.timeout.ms``): it spans the whole write-back of the records in flight,
#: the seeded checkpoints and the offsets, which a job's own ``transaction.timeout.ms`` (60 s
#: by default, less for a faster failover) would cut short. Safe to make long: a transaction
#: a dead restore left open is aborted by the next restore's ``init_transactions``, and no
#: worker starts before one.
RESTORE_TRANSACTION_TIMEOUT_MS = 900_000


def _restore_producer(
    kafka_config: dict[str, Any], pipeline: Pipeline, admin: AdminClient, guard: _RestoreGuard
) -> Producer:
    """The producer a restore writes the records in flight back with. Exactly-once: a
    transactional one, initialized: ``init_transactions`` with the job's restore id aborts
    the transaction an earlier restore of the job left open (killed or frozen while it wrote
    back) and fences that restore, so that, woken, it cannot commit its records in flight or
    the job's offsets (``_reset_offsets``). After the guard's check: a restore that is itself
    the stale one would fence the live one (which then stops, its marker asking for a restore
    again) rather than be stopped. At-least-once (no transactions): an idempotent one."""
    job = pipeline.name
    if not pipeline.exactly_once:
        return Producer({**kafka_config, "enable.idempotence": True, "linger.ms": 20})
    guard.check(admin, "was about to fence the job's earlier restores")
    tid = restore_transactional_id(job)
    config = {**kafka_config, "transactional.id": tid, "linger.ms": 20}
    try:
        producer = Producer({**config, "transaction.timeout.ms": RESTORE_TRANSACTION_TIMEOUT_MS})
        try:
            producer.init_transactions(90)
        except KafkaException as exc:
            error = kafka_error(exc)
            if error is None or error.code() != KafkaError.INVALID_TRANSACTION_TIMEOUT:
                raise
            # The broker's transaction.max.timeout.ms is lower: that one then.
            highest = _broker_transaction_max(admin)
            log.warning(
                "the broker refuses a %d ms transaction for the restore: its "
                "transaction.max.timeout.ms is %s; the write-back of the records in flight "
                "must finish within that",
                RESTORE_TRANSACTION_TIMEOUT_MS,
                highest if highest is not None else "unknown (the job's own limit is taken)",
            )
            if highest is not None:
                config["transaction.timeout.ms"] = highest
            producer = Producer(config)
            producer.init_transactions(90)
    except KafkaException as exc:
        raise CheckpointError(
            f"the restore of job {job} cannot initialize its transactional producer "
            f"(transactional.id {tid}; it needs what the job's workers need: the producer "
            f"settings of kafka_config, a Kafka cluster with transactions and, with ACLs, "
            f"the right to the id): {exc}"
        ) from exc
    return producer


def _broker_transaction_max(admin: AdminClient) -> int | None:
    """A broker's ``transaction.max.timeout.ms`` (None when the cluster does not say)."""
    try:
        brokers = admin.list_topics(timeout=30).brokers
        resource = ConfigResource("broker", str(min(brokers)))
        [future] = admin.describe_configs([resource], request_timeout=30).values()
        entry = future.result(timeout=35).get("transaction.max.timeout.ms")
        return int(entry.value) if entry is not None and entry.value else None
    except (KafkaException, FutureTimeout, ValueError) as exc:
        log.warning("cannot read the broker's transaction.max.timeout.ms: %s", exc)
        return None


@contextlib.contextmanager
def _restore_transaction(producer: Producer, pipeline: Pipeline) -> Iterator[None]:
    """The restore's transaction (exactly-once) around the block, which commits it
    (``_reset_offsets``); aborted when the block raises, so that read_committed readers do
    not wait for it to time out (the next restore's ``init_transactions`` aborts it too)."""
    if not pipeline.exactly_once:
        yield
        return
    try:
        producer.begin_transaction()
    except KafkaException as exc:
        raise CheckpointError(
            f"the restore of job {pipeline.name} cannot begin its transaction: {exc}"
        ) from exc
    try:
        yield
    except BaseException:
        try:
            producer.abort_transaction(30)
        except KafkaException as exc:  # fenced or gone: the next restore aborts it
            log.warning("could not abort the restore's transaction: %s", exc)
        raise


def _reset_offsets(
    admin: AdminClient,
    kafka_config: dict[str, Any],
    pipeline: Pipeline,
    producer: Producer,
    offsets: list[TopicPartition],
    check: Callable[[str], None],
) -> None:
    """Commit the job's offsets (the positions naming the seeded checkpoints) and, exactly
    once, the restore's transaction with them in it. Offsets committed after the savepoint
    (the job ran on) must not survive: those not overwritten here are removed by deleting the
    group first (it is empty: the guard's check), and only when there are any.

    ``check`` (the restore's guard) is asked before the delete and right before the commit.
    A restore frozen after that last check and woken after another restore's
    ``init_transactions`` has been fenced by it: its commit fails, so neither its records in
    flight (written back a second time) nor its offsets (the job rewound to the savepoint,
    when it wakes while the job is stopped) become visible. Both were plain writes before.
    At-least-once, they still are."""
    job = pipeline.name
    check("was about to reset the job's offsets")
    if _offsets_beyond(admin, job, offsets):
        # Only then: a restore frozen right here and woken once the job ran and stopped again
        # would delete the job's offsets (every task then refused at its start, offsets
        # missing beside checkpoints marked committed). Those it commits are overwritten.
        try:
            admin.delete_consumer_groups([job], request_timeout=30)[job].result(timeout=35)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.GROUP_ID_NOT_FOUND:
                raise CheckpointError(f"cannot reset the offsets of {job}: {exc}") from exc
    consumer = Consumer({**kafka_config, "group.id": job, "enable.auto.commit": False})
    try:
        if pipeline.exactly_once and offsets:
            # Not a member (generation -1): the broker accepts a transaction's offsets so even
            # from a group with members; the guard's check before the commit is what keeps a
            # running job's offsets. Bounded: the call can block for good when the group's
            # coordinator does not answer (kafka_calls.py); the next restore aborts it then.
            try:
                BoundedCall("the restore's producer")(
                    "send_offsets_to_transaction",
                    90.0,
                    producer.send_offsets_to_transaction,
                    offsets,
                    consumer.consumer_group_metadata(),
                    60,
                )
            except (KafkaException, KafkaClientError) as exc:
                raise CheckpointError(
                    f"the restore of job {job} cannot commit the job's offsets: {exc}"
                ) from exc
        check(
            "was about to commit the records in flight and the job's offsets"
            if pipeline.exactly_once
            else "was about to commit the job's offsets"
        )
        FaultInjector().point("restore_before_commit")
        if not pipeline.exactly_once:
            consumer.commit(offsets=offsets, asynchronous=False)
    finally:
        consumer.close()
    if pipeline.exactly_once:
        _commit(producer, job)


def _offsets_beyond(admin: AdminClient, job: str, offsets: list[TopicPartition]) -> bool:
    """The job's group has committed offsets the restore does not overwrite (a source
    partition the savepoint has none for, a partition of a topic the job no longer reads), or
    Kafka cannot say: then the group is deleted first, so that none survives."""
    seeded = {(tp.topic, tp.partition) for tp in offsets}
    try:
        futures = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(job)], request_timeout=30
        )
        found = futures[job].result(timeout=35).topic_partitions or []
    except (KafkaException, FutureTimeout) as exc:
        error = kafka_error(exc)
        if error is not None and error.code() == KafkaError.GROUP_ID_NOT_FOUND:
            return False
        log.info("cannot list the offsets of group %s (%s): it is deleted first", job, exc)
        return True
    return any(tp.offset >= 0 and (tp.topic, tp.partition) not in seeded for tp in found)


def _commit(producer: Producer, job: str) -> None:
    """Commit the restore's transaction; a retriable error is asked again within a minute."""
    deadline = time.monotonic() + 60
    while True:
        try:
            producer.commit_transaction(max(1.0, deadline - time.monotonic()))
            return
        except KafkaException as exc:
            error = kafka_error(exc)
            if error is not None and error.retriable() and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            if error is not None and classify(error) is ErrorClass.FATAL:
                raise CheckpointError(
                    f"the restore of job {job} was about to commit the records in flight and "
                    f"the job's offsets, but Kafka fenced its producer ({error.str()}): "
                    "another restore of the job fenced it (one of the two stalled past the "
                    "restore lock's session), or its transaction outlived "
                    f"transaction.timeout.ms. It stops before changing anything more; "
                    "a restore started again finishes the job's if this one was the live one"
                ) from exc
            raise CheckpointError(
                f"the restore of job {job} could not commit the records in flight and the "
                f"job's offsets: {exc}"
            ) from exc


def _produce_in_flight(
    pipeline: Pipeline,
    producer: Producer,
    copies: CheckpointStorage,
    flights: list[tuple[Repartition, SavepointFile]],
    partitions: dict[str, int],
) -> None:
    """The savepoint's in-flight records (their local ``copies``) into the emptied
    repartition topics, each to the partition of its key-group (old partitions in order:
    per-key order is kept), in the restore's transaction (``_restore_transaction``).
    Written without a transaction, a restore frozen before its produce and woken after
    another finished wrote every record in flight a second time."""
    failed: list[Any] = []  # delivery errors: a record the broker refused is not silently lost
    maxp = pipeline.max_parallelism
    sent = 0
    for rep, entry in flights:
        count = partitions[rep.topic]
        table = read_table(copies, entry)
        cols = table.sort_by([("partition", "ascending"), ("offset", "ascending")]).to_pydict()
        # Files of savepoints before headers were kept have no "headers" column.
        all_headers = cols.get("headers") or [None] * len(cols["key"])
        for key, value, timestamp, headers in zip(
            cols["key"], cols["value"], cols["timestamp"], all_headers, strict=True
        ):
            group = zlib.crc32(key[1:]) % maxp  # the key's first byte tags its type
            kept = [(h["name"], h["value"]) for h in headers] if headers else None
            while True:
                try:
                    producer.produce(
                        rep.topic,
                        value,
                        key,
                        partition=repartition_partition(group, count, maxp),
                        timestamp=timestamp,
                        headers=kept,
                        on_delivery=lambda err, _msg: failed.append(err) if err else None,
                    )
                    break
                except BufferError:
                    producer.poll(0.1)
                except KafkaException as exc:
                    # As the repartition writer does: a record its headers take over this
                    # producer's message.max.bytes goes without them.
                    error = kafka_error(exc)
                    if not kept or error is None or error.code() != KafkaError.MSG_SIZE_TOO_LARGE:
                        raise
                    kept = None
            sent += 1
    if producer.flush(60):
        raise CheckpointError("records in flight could not be written back within 60 s")
    if failed:
        raise CheckpointError(
            f"{len(failed)} records in flight could not be written back: {failed[0]}"
        )
    log.info("restored %d records in flight to the repartition topics", sent)


def in_flight_counts(savepoint: SavepointMetadata) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for flight in savepoint.in_flight:
        counts[flight.name] += sum(f.rows for f in flight.files)
    return dict(counts)
