"""A worker: one OS process, one member of the job's consumer group, running its tasks.

Read top to bottom to follow a record and a barrier:

1. ``run`` polls a batch from the consumer and appends each partition's messages to the
   channel of its task (``Task.enqueue``).
2. Every ``checkpoint_interval`` (and only when no checkpoint is in flight) the coordinator
   triggers checkpoint n: every task gets ``Barrier(n)`` behind its fetched records; the
   barrier positions are the next offsets to read.
3. Tasks process their channels; at the aligned barrier they snapshot state synchronously and
   pre-commit their sinks, then hand the snapshot to the coordinator, which materializes it on
   background threads while the task processes epoch n+1 (its Kafka output is held back).
4. When all tasks' metadata is durable, the worker commits the Kafka transaction of epoch n
   with the source offsets (metadata names checkpoint n): the COMMIT POINT. Then the other
   sinks commit n, old checkpoints are retired, and transaction n+1 begins.
5. On partition assignment (and after any failed checkpoint) tasks are restored from the
   checkpoint named by the committed offsets and the consumer seeks to its positions.

Broker outages (docs/exactly-once.md, "Broker outages"): every blocking client call is
bounded (``kafka_calls``); a checkpoint that cannot commit because the broker is unreachable
makes the worker wait for the broker, then abort the epoch and restore; fatal client errors,
hung calls and outages longer than ``BROKER_OUTAGE_LIMIT`` exit with EX_TEMPFAIL (75) so that
the supervisor restarts the worker. SIGTERM ends the worker within ``STOP_BOUND`` seconds.
A task thread that makes no progress for ``liveness_timeout`` seconds (stuck anywhere, also
outside client calls) ends the worker the same way, with every thread's stack in its log
(``liveness``).

Threads: this module runs on the main (task) thread; only the coordinator's pool, the helper
threads of bounded client calls, the liveness watchdog and the stop timer run elsewhere.
librdkafka runs its own threads.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import confluent_kafka
from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec

from snapline.connectors.config import redact, redact_text
from snapline.pipeline.background import SHUTDOWN_BOUND
from snapline.pipeline.checkpoint.identity import JobIdentity, check_storage_identity
from snapline.pipeline.checkpoint.metadata import (
    METADATA_FILE,
    CheckpointRef,
    TaskCheckpoint,
    decode_checked,
    delete_checkpoint,
    encode_checked,
    is_marked_committed,
    list_checkpoints,
    mark_committed,
    raise_id_floor,
    read_id_floor,
)
from snapline.pipeline.checkpoint.restore import restore_committed
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import (
    CheckpointError,
    CheckpointStorageError,
    ConfigurationError,
    SinkUnavailableError,
    first_in_chain,
)
from snapline.pipeline.graph import Pipeline
from snapline.pipeline.runtime import coverage, departed, incarnation
from snapline.pipeline.runtime.consumer_watch import LIMIT as WATCH_LIMIT
from snapline.pipeline.runtime.consumer_watch import ConsumerStuckError, ConsumerWatch
from snapline.pipeline.runtime.coordinator import CheckpointCoordinator, CompletedCheckpoint
from snapline.pipeline.runtime.faults import FaultInjector
from snapline.pipeline.runtime.kafka_calls import (
    EX_TEMPFAIL,
    HANG_GRACE,
    BoundedCall,
    BrokerOutageError,
    ErrorClass,
    KafkaClientError,
    backoff,
    classify,
    delete_records,
    exit_now,
    installed_client_version,
    is_unavailable,
    kafka_error,
    listed_groups,
    raise_partition_errors,
    release_in_background,
    sleep_unless,
)
from snapline.pipeline.runtime.liveness import DEFAULT_TIMEOUT as DEFAULT_LIVENESS_TIMEOUT
from snapline.pipeline.runtime.liveness import Liveness, Watchdog
from snapline.pipeline.runtime.local_lock import lock_local_dir, lock_wait, shared_filesystem
from snapline.pipeline.runtime.metrics import DEFAULT_METRICS_HOST, WorkerMetrics
from snapline.pipeline.runtime.sink_recovery import publish_staged
from snapline.pipeline.runtime.source_ends import SourceEnds
from snapline.pipeline.runtime.task import Task, TaskSnapshot
from snapline.pipeline.runtime.topics import (
    describe_topic_ids,
    describe_topics,
    ids_differ,
    recreated_since,
    topic_id,
)
from snapline.pipeline.runtime.transaction import (
    FencedError,
    TransactionalOutput,
    TransactionFailedError,
    invalid_kafka_settings,
    transaction_timeout,
)
from snapline.pipeline.savepoint.control import (
    MAX_PAUSE,
    PAUSE_LIMIT,
    ControlChannel,
    Request,
    write_ack,
)
from snapline.pipeline.savepoint.markers import RESTORED_FROM, use_topic_generations
from snapline.pipeline.stages import SOURCE_STAGE, task_id_for
from snapline.pipeline.state import create_backend
from snapline.pipeline.state.compat import incompatibility, moved_states, replaced_states
from snapline.pipeline.supervisor import (
    hand_over_message,
    idle_healthy_after,
    report_committed,
    report_idle_healthy,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

BATCH_SIZE = 2000
#: Output records held for later epochs before the worker stops reading and waits.
MAX_HELD_RECORDS = 500_000
# Longer than the default transaction.timeout.ms (60 s): the longest a previous owner's
# pending transactional offsets can keep a partition's committed offset unreadable.
COMMITTED_OFFSETS_WAIT = 90.0
#: Seconds from a restore to the first checkpoint once input arrived (then the interval).
FIRST_CHECKPOINT_DELAY = 0.1
#: In the job's checkpoint directory: the partitions of its "latest" source topics at its first
#: start (``Worker._latest_partitions_at_start``).
SOURCE_PARTITIONS_FILE = "source-partitions.json"
#: SIGTERM ends the worker within this many seconds, broker or not.
STOP_BOUND = 30.0
#: Seconds one read of the group's members may take (departed.group_members: ListGroups
#: 10 s + 5 s, DescribeGroups 10 s, and a margin), for the liveness watchdog.
MEMBERSHIP_READ_BOUND = 30.0
#: After SIGTERM, the final checkpoint gets this long; then the worker exits without it.
FINAL_CHECKPOINT_BOUND = 15.0
#: A worker waits this long for an unreachable broker before it exits with EX_TEMPFAIL.
BROKER_OUTAGE_LIMIT = 900.0
#: While the worker's consumer sees no broker this long (seconds), a fresh client is asked too:
#: if it reaches the cluster, the consumer is stuck and replaced (see ``_await_broker``).
CONSUMER_BLIND_AFTER = 20.0
#: Records of repartition topics consumed by every retained checkpoint are deleted at most this
#: often (seconds).
REPARTITION_DELETE_INTERVAL = 5.0
#: The ``request_timeout`` of the topic id check before such a deletion; a deletion whose check
#: was asked longer ago than this is not sent (``Worker._delete_in_same_topic``).
REPARTITION_ID_CHECK_BOUND = 10.0
#: Seconds the first read of the committed offsets at a restore may take; a failed one looks
#: for a departed worker's pending offsets (``_fence_pending_writers``), then the reads go on.
FIRST_COMMITTED_TIMEOUT = 2.0
#: Bound of the namesake check before a fenced producer is replaced (seconds, each call).
REFENCE_CHECK_TIMEOUT = 10.0
#: A fenced consumer is replaced in place at most this often per 10 minutes; more means two
#: live workers share an id, and the worker exits with EX_TEMPFAIL.
MAX_CONSUMER_REPLACEMENTS = 5
#: Seconds after an assignment (and its first committed checkpoint) at which the worker
#: checks that every partition the job reads belongs to some worker (runtime/coverage.py).
COVERAGE_CHECK_DELAY = 5.0
#: Rejoins for partitions assigned to nobody at most this often per 10 minutes; then an error.
MAX_COVERAGE_REJOINS = 3


@dataclass(frozen=True)
class WorkerSettings:
    """How one worker process connects and identifies itself."""

    bootstrap_servers: str
    worker_id: str
    checkpoint_dir: str
    local_dir: str = ""
    #: What to do for a task whose committed offsets are gone while checkpoints that committed
    #: are stored: "fail" (default), "restore-latest" or "reset-state" (see _missing_offsets).
    on_missing_offsets: str = "fail"
    #: Go on from a source partition's log start when retention deleted records the job had
    #: not read (logged, an event); otherwise that stops the job (``_checked_position``).
    skip_deleted_records: bool = False
    #: Read a source topic that was deleted and created again since the task's checkpoint
    #: from its start, keeping the job's state (logged, an event); otherwise that stops the
    #: job (``_recreated_topics``).
    read_recreated_topics: bool = False
    #: Serve Prometheus metrics on this port (None: no endpoint; 0: any free port).
    metrics_port: int | None = None
    #: The address the metrics endpoint binds (--metrics-host); 127.0.0.1: this host only.
    metrics_host: str = DEFAULT_METRICS_HOST
    #: Seconds the task thread may make no progress before the worker dumps every thread's
    #: stack and exits with EX_TEMPFAIL (0: no watchdog; runtime/liveness.py).
    liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT

    def __post_init__(self) -> None:
        departed.check_worker_id(self.worker_id)

    def resolved_local_dir(self) -> Path:
        """This worker's own directory for local state: ``<local_dir>/<worker id>``, else
        beside a local checkpoint directory on one host's own filesystem, else (checkpoints
        in an object store, or on a filesystem other hosts mount too: NFS, SMB...) under the
        user's cache directory. Per worker id, so that workers given one ``--local-dir`` never
        share files, and per host, which is all its lock covers (``local_lock``)."""
        if self.local_dir:
            return Path(self.local_dir) / self.worker_id
        scheme, sep, rest = self.checkpoint_dir.partition("://")
        if not sep or scheme == "file":
            base = Path(rest if sep else self.checkpoint_dir).absolute().parent
            shared = shared_filesystem(base)
            if shared is None:
                return base / ".snapline-local" / self.worker_id
            log.info(
                "the checkpoint directory is on %s, which other hosts may mount too: local "
                "state goes to the cache directory instead of beside it (--local-dir sets it)",
                shared,
            )
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        return Path(cache) / "snapline" / "local" / self.worker_id

    @staticmethod
    def default_worker_id() -> str:
        return os.environ.get("SNAPLINE_WORKER_ID") or socket.gethostname()


class Worker:
    """See module docstring."""

    def __init__(self, pipeline: Pipeline, settings: WorkerSettings) -> None:
        pipeline.validate()
        log.info(
            "confluent-kafka %s, librdkafka %s",
            installed_client_version(),
            confluent_kafka.libversion()[0],
        )
        self.pipeline = pipeline
        self.settings = settings
        self.liveness = Liveness(settings.liveness_timeout or DEFAULT_LIVENESS_TIMEOUT)
        self.faults = FaultInjector()
        self.storage = CheckpointStorage(settings.checkpoint_dir)
        self.local_dir = settings.resolved_local_dir()
        shared = settings.local_dir and shared_filesystem(self.local_dir)
        if shared:
            log.warning(
                "--local-dir %s is on %s, which other hosts may mount too: its lock covers "
                "one host, so two hosts' processes with worker id %r (a frozen one and its "
                "replacement) could both use it. Give each worker a directory of its own "
                "host's (docs/exactly-once.md, 'What may be deleted')",
                self.local_dir,
                shared,
                settings.worker_id,
            )
        #: Held for the process's lifetime: nothing else deletes or writes under local_dir.
        self._local_lock = lock_local_dir(
            self.local_dir, pipeline.name, settings.worker_id, lock_wait()
        )
        kafka_config = {"bootstrap.servers": settings.bootstrap_servers, **pipeline.kafka_config}
        self._kafka_config = kafka_config
        log.info(
            "worker %s of job %s: kafka %s, checkpoints %s",
            settings.worker_id,
            pipeline.name,
            redact(kafka_config),
            settings.checkpoint_dir,
        )
        uids = pipeline.operator_uids()
        states = [
            {**desc.describe(), "id": sid, "operator": node_id, "uid": uids[node_id]}
            for node_id, entries in pipeline.state_ids().items()
            for sid, desc in entries
        ]
        #: (operator uid, state name) -> the code's description, checked against a restored
        #: checkpoint's (state/compat.py).
        self._declared_states = {(d["uid"], d.get("name") or ""): d for d in states}
        #: Background jobs still running when the worker closed (see ``_close``).
        self.hung_jobs: list[str] = []
        self.coordinator = CheckpointCoordinator(
            pipeline.name,
            settings.worker_id,
            self.storage,
            self.faults,
            states=states,
            timeout=pipeline.checkpoint_timeout,
        )
        self.tasks: dict[str, Task] = {}
        self._backend_options = self._shared_backend_options()
        self._stopping = False
        self._failures = 0
        self._last_trigger = time.monotonic()
        self._records_at_trigger = 0
        self._records_at_durable = 0
        #: Rebalance callbacks run so far (a poll that ran one drops its batch: _consume).
        self._rebalances = 0
        #: Set by a restore: the next checkpoint comes FIRST_CHECKPOINT_DELAY after input
        #: arrives instead of a whole interval later, so a restarted or rebalanced worker's
        #: first output is visible sooner (recovery time is restart -> committed output).
        self._first_after_restore = False
        #: Task id -> the committed checkpoint its last restore used (None: none).
        self._restored_from: dict[str, int | None] = {}
        #: The workers that wrote the checkpoints the last restore used (runtime/departed.py).
        self._previous_owners: set[str] = set()
        #: Where the last restore's tasks without a checkpoint start reading a source at its
        #: end ("latest"), committed before they read (``_commit_latest_starts``).
        self._latest_starts: list[TopicPartition] = []
        #: A failed checkpoint left the tasks dropped; they are rebuilt on the next step,
        #: after the consumer has had a chance to report a lost assignment.
        self._restore_pending = False
        #: An exception raised in a rebalance callback, re-raised after the poll (_consume).
        self._callback_error: Exception | None = None
        #: The thread running a rebalance callback now (inside consume): the consumer's
        #: calls it makes run on it, not on a helper (kafka_calls.BoundedCall, ``inline``).
        self._callback_thread: int | None = None
        self._metrics_path = os.environ.get("SNAPLINE_METRICS_FILE")
        #: Prometheus metrics (--metrics-port) and the checkpoint history in storage.
        self.metrics = WorkerMetrics(
            pipeline.name,
            settings.worker_id,
            settings.checkpoint_dir,
            settings.metrics_port,
            addr=settings.metrics_host,
        )
        #: Task id -> bytes of state its last restore read (for metrics).
        self._restored_bytes: dict[str, int] = {}
        self.checkpoints_committed = 0
        self._admin: AdminClient | None = None
        self._wait_for_restore()
        # After any restore: one that replaced a repartition topic wrote the new names.
        use_topic_generations(pipeline, self.storage)
        #: The job's restored-from-savepoint marker as this worker's plan saw it: a restore
        #: that completes after this point (between the wait above and the worker's join)
        #: leaves the plan the old job's (``_check_not_restored_since_start``).
        self._restored_marker = self._read_restored_marker()
        self.plan = pipeline.stages()
        self._stage_of_topic = self.plan.stage_of_topics(pipeline.source_topics())
        self._repartitioned = {rep.topic for rep in self.plan.repartitions.values()}
        #: Partitions per topic the job reads or writes (the topic plan at start), and the
        #: producer settings that keep its batches within the output topics' size limit.
        self._topic_partitions, producer_limits = self._check_topics()
        #: Repartition-topic positions of the last committed checkpoints, per task: records
        #: below the oldest retained one are dead (``_delete_consumed_records``).
        self._repartition_positions: dict[str, list[dict[tuple[str, int], int]]] = {}
        self._last_delete = time.monotonic()
        #: The repartition topics' ids when this worker started: the positions above are
        #: offsets of those topics, not of a topic a savepoint restore created since.
        self._repartition_topic_ids = self._topic_ids(sorted(self._repartitioned))
        #: Id of every topic the tasks read, as read at their last restore; each checkpoint
        #: commits only after the ids were read again (started at its trigger) and are the
        #: same: a topic deleted and created again under the worker is noticed before any
        #: of its records' effects commit (``_check_read_topics``).
        self._read_topic_ids: dict[str, str] = {}
        self._read_topics: set[str] = set()
        self._id_check: dict[str, Any] | Exception | None = None
        # Tests that read a repartition topic back whole keep every record.
        self._keep_repartition_records = bool(
            os.environ.get("SNAPLINE_TEST_KEEP_REPARTITION_RECORDS")
        )
        self.cluster_id = self._check_identity()
        #: Partitions of each "latest" source topic when the job first started.
        self._latest_at_start = self._latest_partitions_at_start()
        self._added_partitions: set[tuple[str, int]] = set()
        #: Tasks whose checkpoints --reset-state deleted: they start over at the starting
        #: position, "latest" included.
        self._reset_tasks: set[str] = set()
        from snapline.pipeline.runtime.topics import check_repartition_owners

        check_repartition_owners(kafka_config, pipeline)
        if pipeline.exactly_once:
            departed.check_no_namesake(kafka_config, pipeline.name, settings.worker_id)
            self.faults.point("after_namesake_check")
        #: This process's mark as the newest incarnation of its worker id, written just
        #: before its first init_transactions or join fences an earlier one (``run``): a
        #: fenced worker whose mark was replaced since stops instead of fencing its successor
        #: (runtime/incarnation.py).
        self.incarnation: incarnation.Incarnation | None = None
        #: A supervised worker quiet this long in a row reports its run healthy without a
        #: committed checkpoint (supervisor.py); quiet since (monotonic) the worker started
        #: or its last checkpoint failed, moved on by the time each restore took.
        self._idle_healthy_after = idle_healthy_after()
        self._quiet_since = time.monotonic()
        transactional_id = (
            departed.transactional_id(pipeline.name, settings.worker_id)
            if pipeline.exactly_once
            else None
        )
        producer_config = {
            **kafka_config,
            **producer_limits,
            "client.id": f"{pipeline.name}-{settings.worker_id}",
        }
        #: How long a previous owner's pending transactional offsets can keep a partition's
        #: committed offset unreadable: its transaction's timeout, and a margin.
        self._committed_offsets_wait = COMMITTED_OFFSETS_WAIT
        if pipeline.exactly_once:
            timeout_ms = transaction_timeout(
                kafka_config, pipeline.checkpoint_interval, pipeline.checkpoint_timeout
            )
            producer_config["transaction.timeout.ms"] = timeout_ms
            self._committed_offsets_wait = max(COMMITTED_OFFSETS_WAIT, timeout_ms / 1000 + 30)
        self.output = TransactionalOutput(
            producer_config,
            transactional_id=transactional_id,
            stopping=lambda: self._stopping,
            liveness=self.liveness,
        )
        if pipeline.exactly_once:
            # Two colliding workers started in the same instant both pass the check above;
            # the first fencing tells them apart: the fenced one stops (exit 78) instead of
            # fencing the other in turn with a new producer.
            def may_refence() -> None:
                self._check_incarnation("producer was fenced or failed")
                departed.check_no_namesake(
                    kafka_config, pipeline.name, settings.worker_id, timeout=REFENCE_CHECK_TIMEOUT
                )

            self.output.may_refence = may_refence
        self._consumer_fatal: str | None = None
        # Tests shorten the pause limit to watch holds work (seconds).
        self._pause_limit = float(os.environ.get("SNAPLINE_TEST_PAUSE_LIMIT", PAUSE_LIMIT))
        #: Savepoint requests (snapline savepoint create) arrive on the control channel; while
        #: a savepoint is written the worker is paused: (request id, since).
        try:
            self._control = ControlChannel(kafka_config, pipeline.name, self._pause_limit)
        except KafkaException as exc:  # its consumer is the first one the worker creates
            raise invalid_kafka_settings(exc, "consumer") from exc
        self._paused: tuple[str, float] | None = None
        #: When the current pause began (the holds of a savepoint never extend it past
        #: MAX_PAUSE: a CLI whose export hangs cannot stall the job for good).
        self._paused_at = 0.0
        self._exit_after_savepoint = False
        #: A savepoint request waits until the worker has its assignment (it just started,
        #: or is in a rebalance): its acknowledgement names the tasks it covers.
        self._savepoint_request: Request | None = None
        self._assigned = False
        #: Assignments so far; the coverage check due after the last one (when, and the
        #: checkpoints committed before it), and what a check found (the assignment it was
        #: made under, the partitions no worker holds); rejoins for them (runtime/coverage.py).
        self._assignments = 0
        self._coverage_due: tuple[float, int] | None = None
        self._uncovered: tuple[int, list[tuple[str, int]]] | None = None
        self._coverage_rejoins: list[float] = []
        self.consumer = self._new_consumer()
        self._consumer_call = BoundedCall("consumer", self.liveness, inline=self._in_callback)
        self._outage: BrokerOutageError | None = None
        session_s = float(self._consumer_config()["session.timeout.ms"]) / 1000
        self._watch = ConsumerWatch(
            float(os.environ.get("SNAPLINE_TEST_CONSUMER_LIMIT") or max(WATCH_LIMIT, 3 * session_s))
        )
        #: Before a source partition is called idle, Kafka is asked whether it is read to
        #: its end (a paused or lagging consumer's backlog is not idleness).
        self._source_ends = SourceEnds(self._background_admin, self._read_position)
        self.faults.hooks = {
            "leave": lambda: self.consumer.unsubscribe(),
            "stall": lambda: self.consumer.pause(self._task_partitions()),
        }
        self._consumer_replaced: list[float] = []

    # ------------------------------------------------------------------ setup
    def _shared_backend_options(self) -> dict[str, Any]:
        """Backend options plus, for rocksdb, one block cache shared by the worker's tasks."""
        options = dict(self.pipeline.state_backend_options)
        if self.pipeline.state_backend == "rocksdb" and "shared_cache" not in options:
            from snapline.pipeline.state.rocksdb_options import RocksDBResources

            cache_bytes = int(options.pop("block_cache_bytes", 256 * 1024 * 1024))
            options["shared_cache"] = RocksDBResources(cache_bytes)
        return options

    def _consumer_config(self) -> dict[str, Any]:
        return {
            "session.timeout.ms": 10000,
            "heartbeat.interval.ms": 1000,
            "max.poll.interval.ms": 300000,
            "fetch.wait.max.ms": 50,
            # librdkafka stops fetching a partition whose queue holds queued.min.messages and
            # looks again only after fetch.queue.backoff.ms (default 1 s): a worker that keeps
            # up drains the queue well within that second and then waits, which capped every
            # consumer on the benchmark machine at ~120-220k records/s and kept a second worker
            # from adding throughput (librdkafka #2879). 10 ms looks again at once.
            "fetch.queue.backoff.ms": 10,
            **self._kafka_config,
            "group.id": self.pipeline.name,
            "group.instance.id": departed.instance_id(self.pipeline.name, self.settings.worker_id),
            "client.id": f"{self.pipeline.name}-{self.settings.worker_id}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed",
            "partition.assignment.strategy": "range",
            # Every position is given (a checkpoint's, or the source's start as a logical
            # offset), so a reset only ever means records between it and the log's start were
            # deleted (or the log truncated): an error event, never a silent jump (_consume).
            "auto.offset.reset": "error",
        }

    def _wait_for_restore(self) -> None:
        """Wait while a savepoint restore of this job runs (on any host): it recreates the
        repartition topics and resets the job's offsets, which a worker must not use
        half-done. Says so every 30 s; a failed check lets the worker go on (the restore
        refuses to go on once the job's group has members). Then refuse to start after a
        restore that died half-done (``check_no_interrupted_restore``)."""
        from snapline.pipeline.savepoint.markers import (
            check_no_interrupted_restore,
            restore_group,
        )

        group = restore_group(self.pipeline.name)
        admin = self._background_admin()
        started = said = time.monotonic()
        while True:
            try:
                # ListGroups, not DescribeGroups: no coordinator lookup, which can abort the
                # process when it times out while the cluster comes up (listed_groups).
                running = listed_groups(admin, 10, [group]).get(group, False)
            except Exception as exc:
                log.warning("could not check for a savepoint restore of this job: %s", exc)
                break
            if not running:
                break
            if time.monotonic() - said >= 30:
                said = time.monotonic()
                log.info(
                    "waiting %.0f s for the savepoint restore of job %s to end",
                    said - started,
                    self.pipeline.name,
                )
            time.sleep(1.0)
        check_no_interrupted_restore(self.storage, self.pipeline.name)

    def _check_topics(self) -> tuple[dict[str, int], dict[str, int]]:
        """Fail at start, naming the fix, when a source topic is missing or the sources are
        not co-partitioned; create missing output, dead-letter and repartition topics (the
        rule: snapline/pipeline/runtime/topics.py). Returns the partitions per topic, and the
        producer settings that keep record batches within the smallest ``max.message.bytes``
        of the topics the job writes (``topics.producer_size_limits``)."""
        from snapline.pipeline.runtime.topics import TopicManager, pipeline_topics

        manager = TopicManager(self._kafka_config, self.settings.bootstrap_servers)
        specs = pipeline_topics(self.pipeline)
        ensured = manager.ensure(specs)
        partitions = dict(ensured.partitions)
        manager.accept_any_event_time([s for s in specs if s.name not in ensured.create])
        limits: dict[str, int] = {}
        found = self._record_limits(manager)
        if found is not None:
            topic, limit, limits = found
            log.info(
                "topic %s accepts record batches of at most %d bytes: producer %s",
                topic,
                limit,
                ", ".join(f"{k}={v}" for k, v in limits.items()),
            )
        for stage in self.plan.stages:
            counts = {topic: partitions[topic] for topic in stage.reads}
            if len(set(counts.values())) > 1:
                raise ConfigurationError(
                    f"the repartition topics read by one stage (through connect or union) "
                    f"have different partition counts {counts}; declare the same partitions= "
                    "on their key_by operators"
                )
        return partitions, limits

    def _check_identity(self) -> str:
        """The Kafka cluster id, checked against the one the job's checkpoints were made on."""
        admin = AdminClient(self._kafka_config)
        try:
            cluster_id = admin.list_topics(timeout=30).cluster_id
        except KafkaException as exc:
            raise ConfigurationError(
                f"cannot reach Kafka at {self.settings.bootstrap_servers}: {exc}"
            ) from exc
        if not cluster_id:
            log.warning("Kafka did not report a cluster id; the job identity is not checked")
            return ""
        check_storage_identity(
            self.storage,
            JobIdentity(self.pipeline.name, cluster_id),
            self.settings.bootstrap_servers,
        )
        return str(cluster_id)

    # ------------------------------------------------------------------ rebalance
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info("assigned %s", sorted((p.topic, p.partition) for p in partitions))
        self._assigned = True
        self._assignments += 1
        self._coverage_due = (time.monotonic() + COVERAGE_CHECK_DELAY, self.checkpoints_committed)
        self._watch.assigned()
        self._event({"event": "assigned", "partitions": len(partitions)})
        self._drop_tasks()
        self._restore_pending = False
        started = time.monotonic()
        restored = self._restore(partitions)
        assigned = [TopicPartition(t, p, off) for (t, p), off in restored.items()]
        consumer.assign(assigned)
        if self._paused is not None or self._savepoint_request is not None:
            # A savepoint is being written (or asked for, and this worker commits and pauses
            # at its next step): read nothing new.
            consumer.pause(assigned)
        self._remove_moved_task_dirs()
        self._event(
            {
                "event": "restored",
                "seconds": round(time.monotonic() - started, 3),
                "checkpoints": self._restored_from,
                "bytes": self._restored_bytes,
                "reason": "assigned",
            }
        )
        if self.pipeline.exactly_once and departed.enabled():
            departed.start(
                self._kafka_config,
                self.pipeline.name,
                self.settings.worker_id,
                self._previous_owners,
                self._event,
            )

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """A rebalance takes the partitions away: commit the work done so far first.

        During an eager rebalance this member's generation is still current while the
        callback runs, so a checkpoint of everything read so far can still commit; the new
        owners then start where this worker stopped instead of redoing up to one interval.
        If that checkpoint fails (or the generation moved on), the epoch is aborted as
        before and the new owners restore the previous checkpoint: correct either way."""
        self._event({"event": "revoked", "partitions": len(partitions)})
        self._assigned = False
        self._watch.unassigned()
        if self.tasks:
            started = time.monotonic()
            before = self.checkpoints_committed
            log.info("revoked %d partitions: committing the open epoch first", len(partitions))
            self._final_checkpoint(reason="revoke")
            self._event(
                {
                    "event": "revoke_checkpoint",
                    "committed": self.checkpoints_committed > before,
                    "seconds": round(time.monotonic() - started, 3),
                }
            )
        self._drop_tasks()
        self._restore_pending = False

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """The partitions already belong to other members: nothing of the epoch may commit."""
        log.warning("lost %d partitions: aborting the open epoch", len(partitions))
        self._event({"event": "lost", "partitions": len(partitions)})
        self._assigned = False
        self._watch.unassigned()
        self._drop_tasks()
        self._restore_pending = False

    def _drop_tasks(self) -> None:
        """Uncommitted work is discarded; its owner restores from the committed checkpoint."""
        self.metrics.count(self.tasks)  # what the tasks read until now, before they go
        self.output.abort()
        self.coordinator.cancel()
        for task in self.tasks.values():
            task.close()
        self.tasks = {}
        self._source_ends.forget()

    def _remove_moved_task_dirs(self) -> None:
        """Local state of tasks that moved to another worker is deleted (kept ones are reused
        for local recovery when they match the checkpoint)."""
        root = self.local_dir / self.pipeline.name
        if root.is_dir():
            for entry in root.iterdir():
                if entry.is_dir() and entry.name not in self.tasks:
                    shutil.rmtree(entry, ignore_errors=True)

    def _read_restored_marker(self) -> bytes | None:
        path = f"{self.pipeline.name}/{RESTORED_FROM}"
        return self.storage.read_bytes(path) if self.storage.exists(path) else None

    def _check_not_restored_since_start(self) -> None:
        """Raise RestoredSinceStartError when a savepoint restore of the job completed after
        this worker compiled its plan: a restore needs the job's group empty, and one that
        ran entirely while this worker started (after its wait for a running restore, before
        it joined) left it the old job's repartition topics and partition counts. Its tasks
        would write records in flight to a topic the restore replaced (gone, or created
        again by the broker's auto-creation: records nobody reads) or route key-groups by the
        old partition count. A restarted worker reads the job as it is now."""
        if self._read_restored_marker() != self._restored_marker:
            raise RestoredSinceStartError(
                f"a savepoint restore of job {self.pipeline.name} completed after this worker "
                "read the job's topics at its start; it restarts to read them again"
            )

    def _restore(self, partitions: list[TopicPartition]) -> dict[tuple[str, int], int]:
        """Rebuild the tasks of ``partitions`` from their committed checkpoints."""
        if partitions:
            self._check_not_restored_since_start()
        restore_started = time.monotonic()
        by_task: dict[str, list[TopicPartition]] = defaultdict(list)
        for tp in partitions:
            by_task[task_id_for(self._stage_of_topic[tp.topic], tp.partition)].append(tp)
        committed = self._committed_offsets(partitions) if partitions else []
        self.faults.point("after_offsets_read")
        self._read_topics = {tp.topic for tp in partitions}
        # The source topics too (their partition counts), in the same request; nothing
        # when the worker was given no partitions.
        described = (
            describe_topics(
                self._background_admin(),
                self._read_topics | set(self.pipeline.source_topics()),
                "topics the tasks read, and the source topics",
            )
            if partitions
            else {}
        )
        self._read_topic_ids = {
            t: topic_id(d) for t, d in described.items() if t in self._read_topics
        }
        self._grow_source_partitions(described)
        self._check_co_partitioned(by_task, described)
        self._id_check = None
        bounds = self._log_bounds(partitions)
        committed_by_tp = {(c.topic, c.partition): c for c in committed}
        seek: dict[tuple[str, int], int] = {}
        self._restored_from = {}
        self._restored_bytes = {}
        self._previous_owners = set()
        self._latest_starts = []
        if by_task:  # ids stay above those a --reset-state deleted (ID_FLOOR_FILE)
            self.coordinator.observe_restored(read_id_floor(self.storage, self.pipeline.name))
        for task_id, tps in sorted(by_task.items()):
            self.liveness.beat()  # one task's files restored per beat
            positions, ref = self._restore_task(
                task_id, [committed_by_tp[(t.topic, t.partition)] for t in tps], bounds
            )
            seek.update(positions)
            self._restored_from[task_id] = ref.checkpoint_id if ref else None
        self._commit_latest_starts()
        if self.tasks:
            self.output.begin(self.coordinator.next_id)
            for task in self.tasks.values():
                task.epoch = self.coordinator.next_id
        self._last_trigger = time.monotonic()
        self._records_at_trigger = 0
        self._first_after_restore = True
        # A restore's time is not quiet time (a crash after each long restore is a crash
        # loop), but a short one (a rebalance) does not undo the quiet time before it.
        self._quiet_since += time.monotonic() - restore_started
        return seek

    def _commit_latest_starts(self) -> None:
        """Commit where tasks start reading partitions with no committed offset at their end
        ("latest"), before they read anything: naming no checkpoint for a task without one,
        else the task's. Until such a partition's first checkpoint commits, its next owner
        (after a crash, a revoke, a restart) found no offset and resolved "latest" again,
        later: what was written in between had come after the job started and was never
        read. Now it starts where this worker did. A position naming no checkpoint is what a
        task with no state starts from (as a plain commit by another tool would be); the
        next checkpoint's transactional commit comes after it and replaces it. Not while a
        savepoint is being taken (export would take the commit for the job going on): then
        the next owner resolves the end again, as before. A refused commit is logged only;
        a commit that hangs ends the worker (exit 75), as any hung consumer call does."""
        starts, self._latest_starts = self._latest_starts, []
        if not starts or self._paused is not None or self._savepoint_request is not None:
            return
        try:
            self._consumer_call(
                "commit",
                20 + HANG_GRACE,
                lambda: self.consumer.commit(offsets=starts, asynchronous=False),
            )
        except KafkaException as exc:
            error = kafka_error(exc)
            if error is not None and classify(error) is ErrorClass.FATAL:
                raise ConsumerFencedError(f"consumer: commit() failed: {error}") from exc
            log.warning(
                "committing the start of %d partitions read from their end failed (%s): until "
                "their first checkpoint commits, a next owner starts at their end as it is then",
                len(starts),
                exc,
            )
            return
        log.info(
            "reading from the end (latest) at %s, committed for the tasks' next owners",
            {(tp.topic, tp.partition): tp.offset for tp in starts},
        )

    def _restore_state(
        self,
        task_id: str,
        ref: CheckpointRef,
        committed: list[TopicPartition],
        backend: Any,
    ) -> tuple[TaskCheckpoint, CheckpointRef, list[TopicPartition]]:
        """Restore ``backend`` from checkpoint ``ref``; returns its metadata, the checkpoint
        restored and the committed offsets that name it.

        ``_restore_task`` found ``ref`` in storage, but its new owner's retention may delete
        it while its files are read: this worker read the offsets, then froze or stalled
        (its session expiring meanwhile), and the task's new owner committed newer
        checkpoints since. The long chaos test met it: the worker exited with "checkpoint
        file … is missing". Retention deletes a checkpoint only after a newer one committed,
        so when the restore fails and the group's offsets now name a newer checkpoint, the
        first read was stale: that one is restored (the commit protocol fences this worker
        if it does not own the task any more). Otherwise the error stands."""
        for attempt in range(3):
            self.faults.point("before_restore_state")
            try:
                meta = restore_committed(
                    self.storage,
                    self.pipeline.name,
                    task_id,
                    ref,
                    backend,
                    on_corrupt=self.pipeline.on_corrupt_checkpoint,
                )
                return meta, ref, committed
            except CheckpointError as exc:
                if attempt == 2:
                    raise
                fresh, fresh_offsets = self._read_again(task_id, committed)
                if fresh is None or fresh.checkpoint_id <= ref.checkpoint_id:
                    raise
                log.warning(
                    "task %s: restoring checkpoint %d failed (%s), and the committed offsets "
                    "read named it: they were stale; now they name %d",
                    task_id,
                    ref.checkpoint_id,
                    exc,
                    fresh.checkpoint_id,
                )
                ref, committed = fresh, fresh_offsets
        raise AssertionError("unreachable")

    def _read_again(
        self, task_id: str, committed: list[TopicPartition]
    ) -> tuple[CheckpointRef | None, list[TopicPartition]]:
        """The committed offsets of ``committed``'s partitions read again, and the checkpoint
        they name: a first read may be stale (this worker froze or stalled after it)."""
        fresh = self._committed_offsets([TopicPartition(c.topic, c.partition) for c in committed])
        return self._named_checkpoint(task_id, fresh), fresh

    def _check_co_partitioned(
        self, by_task: dict[str, list[TopicPartition]], described: dict[str, Any]
    ) -> None:
        """A stage that reads several topics (a union or a connect of sources) has one task
        per partition number, fed by that partition of every one of them; the group's range
        assignor hands them to one worker only while the topics have as many partitions. A
        source topic grown alone while the job ran split tasks: partition p of one topic went
        to one worker, of the other to another, and both restored task p and committed its
        state, each with half of its input (wrong output), then retention of each deleted
        the other's checkpoints and the job stopped for good once the partitions met again.
        Raises KafkaClientError (exit 75: restarted, it rejoins) before anything is restored
        or committed, naming the fix."""
        topics_of: dict[int, list[str]] = defaultdict(list)
        for topic, stage in self._stage_of_topic.items():
            topics_of[stage].append(topic)
        for stage, topics in sorted(topics_of.items()):
            if len(topics) < 2:
                continue
            counts = {
                t: len(getattr(described[t], "partitions", ()) or ())
                for t in sorted(topics)
                if t in described
            }
            if len(set(counts.values())) > 1:
                if self._repartitioned & set(counts):
                    # A repartition topic's partitions are the stage's tasks, keyed state by
                    # their count: growing the other topics to match is not a fix.
                    fix = (
                        "A repartition topic's partition count is fixed by the job: take a "
                        "savepoint and restore it (the restore recreates the repartition "
                        "topics with the partitions the code declares), or give the other "
                        "topics its number"
                    )
                else:
                    fix = (
                        "Give them all the same number (e.g. kafka-topics.sh --alter --topic "
                        "NAME --partitions N)"
                    )
                raise KafkaClientError(
                    f"the topics stage {stage} reads together have different numbers of "
                    f"partitions ({', '.join(f'{t}: {n}' for t, n in counts.items())}): each "
                    "task reads one partition number of all of them, and the consumer group "
                    f"would split it over two workers. {fix}; until then no worker of the "
                    "job restores anything"
                )
        for task_id, tps in sorted(by_task.items()):
            stage = self._stage_of_topic[tps[0].topic]
            missing = sorted(set(topics_of[stage]) - {tp.topic for tp in tps})
            if len(topics_of[stage]) > 1 and missing:
                raise KafkaClientError(
                    f"the consumer group gave this worker task {task_id} without its partition "
                    f"of {', '.join(missing)} (an assignment made before the topics' "
                    "partition counts were the same again): the worker exits to rejoin, "
                    "before it restores or commits anything"
                )

    def _grow_source_partitions(self, described: dict[str, Any]) -> None:
        """Partitions added to a source topic while the job runs make the source stage one
        task per new partition (the consumer group rebalances when it notices them, and every
        task is restored). The keyed stages' tasks take the watermarks of the source stage's
        tasks from their repartition partitions and wait for each of those writers
        (``Task._upstream_writers``, counted from the source topics' partitions): counted at
        start only, a new partition's task was ignored until every worker restarted, so its
        records could come after the watermark had passed them (late: dead letters, or a
        window fired without them). Source topics only: a repartition topic's partitions are
        fixed (``_check_task_count``)."""
        sources = self.pipeline.source_topics()
        grown = {
            t: len(d.partitions)
            for t, d in described.items()
            if t in sources
            and len(getattr(d, "partitions", ()) or ()) > self._topic_partitions.get(t, 0)
        }
        if not grown:
            return
        for topic, count in sorted(grown.items()):
            log.info(
                "source topic %s has %d partitions now (%d when this worker started)",
                topic,
                count,
                self._topic_partitions.get(topic, 0),
            )
        # A new dict: tasks restored before keep the counts they were built with.
        self._topic_partitions = {**self._topic_partitions, **grown}

    def _committed_offsets(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """The committed offsets (and checkpoint names) of ``partitions``.

        A previous owner that sent its offsets to a transaction and then stalled leaves them
        pending; the broker answers an offset fetch for them only once that transaction has
        committed or been aborted (at the latest after its transaction.timeout.ms), so this
        waits rather than start from offsets that are about to change."""
        request = [TopicPartition(tp.topic, tp.partition) for tp in partitions]
        deadline = time.monotonic() + self._committed_offsets_wait
        attempt = 0
        fencing = False  # the departed writers' abort started (once per call)
        while True:
            # The first try is short: pending offsets of a departed writer are worth
            # looking for (below) long before its transaction times out.
            timeout = FIRST_COMMITTED_TIMEOUT if attempt == 0 else 20
            try:
                got = list(
                    self._consumer_call(
                        "committed",
                        timeout + HANG_GRACE,
                        self.consumer.committed,
                        request,
                        timeout,
                    )
                )
                # A partition answered with an error has no offset to read: never "none".
                raise_partition_errors(got, "committed offsets")
                return got
            except KafkaException as exc:
                error = kafka_error(exc)
                if error is not None and classify(error) is ErrorClass.FATAL:
                    raise ConsumerFencedError(f"consumer: committed() failed: {error}") from exc
                if not fencing:
                    self._fence_pending_writers(request)
                    fencing = True
                if time.monotonic() > deadline or self._stopping:
                    # Exit 75: a fresh worker waits again; nothing is lost by the restart.
                    raise KafkaClientError(
                        f"could not read the committed offsets of {len(request)} partitions "
                        f"in {self._committed_offsets_wait:.0f}s: {exc}; is a previous owner's "
                        "transaction still open, or the group coordinator unreachable? If it "
                        "stays so across restarts after a broker crash, the broker may run "
                        "Kafka 4.3.x (KAFKA-20734, see docs/exactly-once.md 'Known limits')"
                    ) from exc
                log.warning("committed offsets not available yet (%s); retrying", exc)
                self._event({"event": "offsets_pending", "error": str(exc)[:200]})
                sleep_unless(lambda: self._stopping, backoff(attempt, cap=2.0))
                attempt += 1

    def _fence_pending_writers(self, partitions: list[TopicPartition]) -> None:
        """The committed offsets of ``partitions`` cannot be read (yet): if a worker that
        left the group for good sent offsets to its transaction and died before it ended it,
        the broker keeps them pending, and unreadable, until that transaction times out
        (``transaction.timeout.ms``, 71 s with the defaults). Such a worker wrote the newest
        checkpoints of those tasks just before, so their writers that are not members of the
        group now have their transactions aborted (``departed.fence_departed``; a writer that
        is a member is left to end its own transaction). All of it in a daemon thread (the
        reads of the offsets go on meanwhile); it does nothing when the abort of departed
        workers is off."""
        tasks = sorted(
            {task_id_for(self._stage_of_topic[tp.topic], tp.partition) for tp in partitions}
        )

        def fence() -> None:
            if not (self.pipeline.exactly_once and departed.enabled()):
                return
            with ThreadPoolExecutor(8, thread_name_prefix="fence-pending-read") as pool:
                found = list(pool.map(self._newest_writers, tasks))
            departed.fence_departed(
                self._kafka_config,
                self.pipeline.name,
                self.settings.worker_id,
                set().union(*found),
                self._event,
            )

        threading.Thread(target=fence, name="fence-pending", daemon=True).start()

    def _newest_writers(self, task_id: str, most: int = 20) -> set[str]:
        """The workers that wrote ``task_id``'s checkpoints newer than its newest one marked
        committed, and that one's (at most ``most`` directories, newest first; one whose
        metadata cannot be read, in progress or being deleted, names nobody). The writer of
        offsets still pending wrote one of them: its metadata comes before the offsets are
        sent, the committed marker after the commit."""
        writers: set[str] = set()
        try:
            refs = list_checkpoints(self.storage, self.pipeline.name, task_id)[-most:]
        except Exception as exc:  # a courtesy: the wait for the timeout stays correct
            log.info("task %s: could not list its checkpoints: %s", task_id, exc)
            return writers
        for ref in reversed(refs):
            try:
                meta = TaskCheckpoint.read(self.storage, self.pipeline.name, task_id, ref)
                writers.add(meta.worker_id)
                if is_marked_committed(self.storage, self.pipeline.name, task_id, ref):
                    break
            except Exception:  # in progress (no metadata yet), or being deleted
                continue
        return writers

    def _restore_task(
        self,
        task_id: str,
        committed: list[TopicPartition],
        bounds: dict[tuple[str, int], tuple[int, int]],
    ) -> tuple[dict[tuple[str, int], int], CheckpointRef | None]:
        ref = self._named_checkpoint(task_id, committed)
        for _ in range(3):
            if ref is None or self.storage.exists(
                f"{ref.directory(self.pipeline.name, task_id)}/{METADATA_FILE}"
            ):
                break
            # Retention deletes a checkpoint only after a newer one committed, so offsets that
            # name a deleted checkpoint were stale when read (this worker may be a zombie
            # that read them before freezing). Read them again rather than fail.
            fresh, committed = self._read_again(task_id, committed)
            if fresh == ref or fresh is None:
                break  # really missing: restore_committed below says so
            log.warning(
                "task %s: the committed offsets read named checkpoint %d, which is deleted: "
                "they were stale; now they name %d",
                task_id,
                ref.checkpoint_id,
                fresh.checkpoint_id,
            )
            ref = fresh
        stored = list_checkpoints(self.storage, self.pipeline.name, task_id)
        if ref is None and stored:
            ref = self._missing_offsets(task_id, stored, committed)
        elif ref is not None:
            ref = self._check_lost_commit(task_id, ref, stored, committed)
        backend = create_backend(
            self.pipeline.state_backend,
            task_dir=str(self.local_dir / self.pipeline.name / task_id),
            options=self._backend_options,
        )
        backend.progress = self.liveness.beat  # a beat per state file restored
        meta: TaskCheckpoint | None = None
        recreated: set[str] = set()
        if ref is not None:
            meta, ref, committed = self._restore_state(task_id, ref, committed, backend)
            self._check_states(task_id, meta)
            self._check_task_count(task_id, meta, self._stage_of_topic[committed[0].topic])
            recreated = self._recreated_topics(task_id, meta)
            self._previous_owners.add(meta.worker_id)
            if meta.state is not None:
                self._restored_bytes[task_id] = sum(f.size for f in meta.state.files)
                self.metrics.restored_files(task_id, meta.state)
            if not is_marked_committed(self.storage, self.pipeline.name, task_id, ref):
                # The committed offsets prove it: the worker that committed it died before
                # its marker was written.
                mark_committed(self.storage, self.pipeline.name, task_id, ref)
        # Nothing is deleted here: a checkpoint newer than the committed one may be in flight
        # on the worker that owns the task by now (this one may be a zombie that read stale
        # offsets). Ids continue above every stored one, so retention deletes such leftovers
        # once a checkpoint with a higher id commits.
        if stored:
            self.coordinator.observe_restored(stored[-1].checkpoint_id)
        positions: dict[tuple[str, int], int] = {}
        start = {
            t: (OFFSET_END if s.starting_position == "latest" else OFFSET_BEGINNING)
            for s in self.pipeline.sources()
            for t in s.topic_list
        }
        start.update(dict.fromkeys(self._repartitioned, OFFSET_BEGINNING))
        for c in committed:
            tp = (c.topic, c.partition)
            if c.topic in recreated:
                positions[tp] = OFFSET_BEGINNING
            elif meta is not None and tp in meta.positions:
                positions[tp] = meta.positions[tp]
            elif c.offset >= 0:
                positions[tp] = c.offset
            else:
                positions[tp] = self._added_partition_start(task_id, tp, start[c.topic])
        task_epoch = self.coordinator.next_id
        self.coordinator.observe_restored(ref.checkpoint_id if ref else None)
        channels = self._channel_positions(positions, bounds)
        # A partition started at its end ("latest") with no offset committed: a task without
        # a checkpoint, or a topic the code reads since. Pinned for next owners, naming the
        # task's checkpoint if it has one (all its partitions must name the same).
        latest = [tp for tp, o in positions.items() if o == OFFSET_END and channels[tp] >= 0]
        named = ref.offset_metadata() if ref is not None else ""
        self._latest_starts += [
            TopicPartition(t, p, channels[(t, p)], metadata=named) for t, p in latest
        ]
        # The consumer starts at the end as resolved, the one committed for next owners.
        positions.update({tp: channels[tp] for tp in latest})
        # The consumer starts where the channels do (a position checked against the log may
        # move to its start: --skip-deleted-records); logical offsets stay for the broker.
        positions = {tp: channels[tp] if o >= 0 else o for tp, o in positions.items()}
        task = Task(
            task_id,
            self.pipeline,
            channels,
            backend,
            self.output,
            worker_id=self.settings.worker_id,
            epoch=max(task_epoch, self.coordinator.next_id),
            on_snapshot=self._on_task_snapshot,
            faults=self.faults,
            cluster_id=self.cluster_id,
            stage=self._stage_of_topic[committed[0].topic],
            plan=self.plan,
            topic_partitions=self._topic_partitions,
            time_state=meta.time if meta is not None else None,
            source_ends=self._source_ends,
            topic_ids={
                c.topic: self._read_topic_ids[c.topic]
                for c in committed
                if self._read_topic_ids.get(c.topic)
            },
        )
        self.faults.point("before_sink_recovery")
        task.recover_sinks(ref.checkpoint_id if ref else None, meta.sinks if meta else {})
        above = task.sink_checkpoint_ids_above()
        if above is not None and above >= self.coordinator.next_id:
            # The storage holds lower ids than a sink already applied: it was wiped or
            # replaced. Ids below would be silently dropped by the PostgreSQL sink's upsert.
            log.warning(
                "task %s: a sink holds output of checkpoint %d, above this job's checkpoint "
                "ids in %s (was the checkpoint storage wiped or replaced?); checkpoint ids go "
                "on above it",
                task_id,
                above,
                redact_text(self.storage.uri),
            )
            self.coordinator.observe_restored(above)
        self.tasks[task_id] = task
        log.info(
            "task %s restored from %s at %s",
            task_id,
            f"checkpoint {ref.checkpoint_id}" if ref else "no checkpoint",
            positions,
        )
        return positions, ref

    def _publish_before_reset(self, task_id: str, latest: CheckpointRef) -> None:
        """Publish what ``latest``, the task's newest checkpoint marked committed, staged in
        its Parquet and PostgreSQL sinks (with every older one it still lists), before
        --reset-state deletes it. Kafka committed its records; a worker that died between
        that commit and the sinks' publish left them staged, and with the checkpoint gone
        the fresh task took them for an uncommitted epoch's and discarded them at its first
        commit: Kafka had the records, the table and the database never did. A failed
        publish fails the restore with the checkpoints kept, for the next try. A checkpoint
        whose metadata cannot be read is logged: its output cannot be found."""
        try:
            meta = TaskCheckpoint.read(self.storage, self.pipeline.name, task_id, latest)
        except CheckpointError as exc:
            log.error(
                "task %s: cannot read checkpoint %d (%s): what it staged in Parquet and "
                "PostgreSQL sinks, if anything, is not published",
                task_id,
                latest.checkpoint_id,
                exc,
            )
            return
        publish_staged(
            self.pipeline,
            {sink.name: sink for sink in self.pipeline.sinks()},
            task_id,
            self.settings.worker_id,
            latest.checkpoint_id,
            meta.sinks,
            self.output,
            self.cluster_id,
        )

    def _latest_partitions_at_start(self, start_over: bool = False) -> dict[str, int]:
        """The partitions each source topic read from "latest" had when the job first started,
        recorded by its first worker in ``<job>/source-partitions.json`` with the topic's id
        (a topic the code reads since is recorded when first seen; an id missing from a file
        of an earlier version is filled in). A partition beyond them was added while the job
        ran: ``_added_partition_start``. ``start_over`` (--reset-state) records the counts
        now: the job starts again, and its start is now. Sets ``_latest_ids``, the ids the
        counts are of.

        A topic recorded with another id was deleted and created again after the job
        started: all of it came after that start, so it is recorded with no partitions, and
        its partitions with no committed offset are read from their beginning (with
        ``--read-recreated-topics`` the ones the job's checkpoints read start there too).
        Before, they started at their end: what producers wrote to the new topic before the
        job's first checkpoint of it was never read. A ``--reset-state`` run starts over:
        such a topic is recorded with its partitions now (only such a topic: the partitions
        others gained while the job was down were still added after its start)."""
        self._latest_ids: dict[str, str] = {}
        latest = sorted(
            {
                t
                for s in self.pipeline.sources()
                if s.starting_position == "latest"
                for t in s.topic_list
            }
        )
        if not latest:
            return {}
        path = f"{self.pipeline.name}/{SOURCE_PARTITIONS_FILE}"
        counts: dict[str, int] = {}
        ids: dict[str, str] = {}
        if self.storage.exists(path):
            body = decode_checked(self.storage.read_bytes(path), self.storage.full_path(path))
            counts = {str(t): int(n) for t, n in body.get("partitions", {}).items()}
            ids = {str(t): str(i) for t, i in body.get("ids", {}).items()}
        now = self._topic_ids(latest, "latest source topics")
        # Only a recreated topic is taken as new by a --reset-state run: the partitions other
        # topics gained while the job was down were still added after its start.
        reset_run = start_over or self.settings.on_missing_offsets == "reset-state"
        stale = [
            t
            for t in latest
            if t in self._topic_partitions
            and (start_over or t not in counts or ids_differ(ids.get(t, ""), now.get(t, "")))
        ]
        unnamed = [t for t in latest if t in counts and t not in stale and not ids.get(t)]
        if stale or any(now.get(t) for t in unnamed):
            recreated = {
                t
                for t in stale
                if not reset_run and t in counts and ids_differ(ids.get(t, ""), now.get(t, ""))
            }
            for topic in sorted(recreated):
                log.info(
                    "source topic %s was created again since the job started (id %s, now %s): "
                    "its partitions with no committed offset are read from their beginning",
                    topic,
                    ids[topic],
                    now[topic],
                )
            counts.update({t: 0 if t in recreated else self._topic_partitions[t] for t in stale})
            ids.update({t: now[t] for t in [*stale, *unnamed] if now.get(t)})
            self.storage.write_bytes(path, encode_checked({"partitions": counts, "ids": ids}))
        # A --reset-state run takes a topic created again while it runs as new too.
        self._latest_ids = (
            {} if reset_run else {t: ids[t] for t in latest if t in counts and ids.get(t)}
        )
        return {t: counts[t] for t in latest if t in counts}

    def _added_partition_start(self, task_id: str, tp: tuple[str, int], start: int) -> int:
        """Where a partition with no committed offset starts: the source's starting position,
        except that a partition added to a "latest" source after the job started is read from
        its beginning (as Flink reads the partitions it discovers): "latest" means the end
        when the job started, and every record of a partition added since came after that.
        Before, such a partition started at its end when first assigned, and what producers
        wrote to it until the consumer noticed it (up to topic.metadata.refresh.interval.ms,
        5 minutes by default) was never read. So is every partition of a topic created
        again since the counts were read (its id at this restore differs from theirs: the
        worker ran while it was deleted and created). A task --reset-state started over
        starts at the starting position, "latest" included."""
        topic, partition = tp
        if start != OFFSET_END or task_id in self._reset_tasks:
            return start
        recreated = ids_differ(self._latest_ids.get(topic, ""), self._read_topic_ids.get(topic, ""))
        if not recreated and partition < self._latest_at_start.get(topic, partition + 1):
            return start
        if tp not in self._added_partitions:
            self._added_partitions.add(tp)
            if recreated or not self._latest_at_start.get(topic):
                log.info(
                    "%s was created again since the job started: %s[%d] is read from its beginning",
                    topic,
                    topic,
                    partition,
                )
            else:
                log.info(
                    "%s[%d] was added after the job started (it had %d partitions then): read "
                    "from its beginning",
                    topic,
                    partition,
                    self._latest_at_start[topic],
                )
            self._event({"event": "source_partition_added", "topic": topic, "partition": partition})
        return OFFSET_BEGINNING

    def _recreated_topics(self, task_id: str, meta: TaskCheckpoint) -> set[str]:
        """The source topics the checkpoint read that were deleted and created again since
        (Kafka gives a created topic a new id): its positions are offsets of the old topic,
        and going on from them would skip the new topic's first records, silently when they
        fall inside its log. The job stops, unless ``read_recreated_topics`` says to read
        such a topic from its start with the job's state (logged, an event). A repartition
        topic recreated under the job (a savepoint restore while this worker was frozen)
        always stops it."""
        recreated = set(self._changed_ids(meta))
        if not recreated:
            return recreated
        now = self._read_topic_ids
        names = ", ".join(f"{t} (id {meta.topic_ids[t]}, now {now[t]})" for t in sorted(recreated))
        if recreated & self._repartitioned:
            raise ConfigurationError(
                f"task {task_id}: repartition topics {names} were created again since its "
                f"checkpoint {meta.checkpoint_id} (a savepoint restore while this worker was "
                "stopped or frozen?): the checkpoint's positions are offsets of the old topics. "
                "Start the workers again: they restore what the savepoint restore set"
            )
        if not self.settings.read_recreated_topics:
            raise ConfigurationError(
                f"task {task_id}: source topics {names} were deleted and created again since "
                f"its checkpoint {meta.checkpoint_id}: the checkpoint's positions are offsets "
                "of the old topics, and going on from them would skip or repeat records of the "
                "new ones. Nothing of the new topics was committed. Restart with "
                "--read-recreated-topics to read them from their start with the job's state, "
                "or run the job under a new name to start over"
            )
        log.error(
            "task %s: source topics %s were created again since checkpoint %d: reading them "
            "from their start with the job's state (--read-recreated-topics)",
            task_id,
            names,
            meta.checkpoint_id,
        )
        for topic in sorted(recreated):
            self._event(
                {
                    "event": "source_topic_recreated",
                    "task": task_id,
                    "topic": topic,
                    "checkpoint": meta.checkpoint_id,
                    "old_id": meta.topic_ids[topic],
                    "new_id": self._read_topic_ids[topic],
                }
            )
        return recreated

    def _check_task_count(self, task_id: str, meta: TaskCheckpoint, stage: int) -> None:
        """Refuse a keyed task's checkpoint taken with another number of tasks in its stage:
        key-groups map to tasks by that count, so a key's state would sit in one task while
        its records go to another (partitions added by hand to a repartition topic that
        declares no ``partitions=``). A savepoint restore is the way to change it."""
        reads = self.plan.stages[stage].reads
        if meta.task_count is None or stage == SOURCE_STAGE or not reads:
            return
        now = self._topic_partitions.get(reads[0])
        if now is not None and now != meta.task_count:
            raise ConfigurationError(
                f"task {task_id}: its checkpoint {meta.checkpoint_id} was taken with "
                f"{meta.task_count} tasks in its stage, but {reads[0]} has {now} partitions "
                "now (added by hand?). Key-groups map to tasks by that count: a key's state "
                "would be in one task and its records in another. A repartition topic cannot "
                "shrink: restore a savepoint taken before the change (the restore recreates "
                "the topic with the partitions the code declares), or run the job under a new "
                "name"
            )

    def _check_states(self, task_id: str, meta: TaskCheckpoint) -> None:
        """Refuse to go on from a checkpoint whose state the code would read wrong: a state's
        kind, serde, TTL or map key serde changed since (state/compat.py), or its id. Stored
        entries carry their state's id, and ids are numbered by position (declared states in
        graph order, then every operator's timers): a state added, removed or reordered moves
        the ids after it, and the code would read one state's values as another's and lose
        every timer, silently; so would a state renamed or replaced at its id. A savepoint
        maps states by name instead."""
        problems = []
        moved = moved_states(meta.states, self._declared_states, self.pipeline.operator_uids())
        if moved:
            raise ConfigurationError(
                f"task {task_id} cannot continue from checkpoint {meta.ref.checkpoint_id} with "
                f"this code: states {moved} are numbered differently (a state or "
                "a stateful operator was added, removed or moved before them; checkpoints "
                "store states by number). Go through a savepoint, which maps states by name: "
                "with the job stopped, 'snapline savepoint from-checkpoint SPEC' with this "
                "code, then 'snapline run SPEC --from-savepoint PATH'"
            )
        replaced = replaced_states(
            meta.states, self._declared_states, f"checkpoint {meta.ref.checkpoint_id}"
        )
        if replaced:
            raise ConfigurationError(
                f"task {task_id} cannot continue from checkpoint {meta.ref.checkpoint_id} with "
                f"this code: {'; '.join(replaced)}. Checkpoints store states by number, so the "
                "code's state would read the other's entries as its own. Go through a "
                "savepoint, which maps states by operator uid and name: with the job stopped, "
                "'snapline savepoint from-checkpoint SPEC' with this code, then 'snapline run "
                "SPEC --from-savepoint PATH --allow-non-restored-state' (a renamed state starts "
                "empty, the old one is dropped); or continue with the code that wrote the "
                "checkpoint"
            )
        for stored in meta.states:
            now = self._declared_states.get((stored.get("uid"), stored.get("name") or ""))
            if now is None or "kind" not in stored:
                continue
            # A checkpoint's description names the TTL whenever there is one.
            stored = {**stored, "ttl_ms": stored.get("ttl_ms")}
            where = f"state {stored.get('name')!r} of operator {stored.get('uid')!r}"
            problem = incompatibility(stored, now, where, f"checkpoint {meta.ref.checkpoint_id}")
            if problem is not None:
                problems.append(problem)
        if problems:
            raise ConfigurationError(
                f"task {task_id} cannot continue from its checkpoint with this code: "
                + "; ".join(problems)
            )

    @staticmethod
    def _named_checkpoint(task_id: str, committed: list[TopicPartition]) -> CheckpointRef | None:
        """The checkpoint the task's committed offsets name (None: no commit yet)."""
        refs = {CheckpointRef.parse_offset_metadata(c.metadata) for c in committed if c.offset >= 0}
        if len(refs) > 1:
            raise CheckpointError(
                f"partitions of task {task_id} name different checkpoints {sorted(map(str, refs))};"
                " were source topics added to a running pipeline? Start it under a new name"
            )
        return refs.pop() if refs else None

    def _channel_positions(
        self,
        positions: dict[tuple[str, int], int],
        bounds: dict[tuple[str, int], tuple[int, int]],
    ) -> dict[tuple[str, int], int]:
        """Logical offsets (beginning/end) resolved by the broker, and every restored position
        checked against the partition's log (``_checked_position``). The log's ``bounds`` come
        from ``_log_bounds`` (read for every partition of the assignment at once); a partition
        it could not tell is asked alone, and so is one whose position lies past that end: the
        bounds may be older than the position (offsets read again during the restore can name
        a newer owner's checkpoint), and their end is the last stable offset, while a refusal
        needs the log's end (the high watermark) as it is now."""
        resolved = {}
        for tp, offset in positions.items():
            try:
                known = bounds.get(tp)
                if known is None or offset > known[1]:
                    known = self.consumer.get_watermark_offsets(TopicPartition(*tp), timeout=30)
                low, high = known
            except KafkaException as exc:
                if offset < 0:
                    raise
                log.warning(
                    "%s[%d]: cannot check position %d against the log: %s", *tp, offset, exc
                )
                resolved[tp] = offset
                continue
            if offset == OFFSET_BEGINNING:
                offset = low
            elif offset < 0:  # the end: the last stable offset, asked alone if need be
                offset = bounds[tp][1] if tp in bounds else self._stable_end(tp, high)
            else:
                offset = self._checked_position(tp, offset, low, high)
            resolved[tp] = offset
        return resolved

    def _stable_end(self, tp: tuple[str, int], high: int) -> int:
        """The partition's last stable offset (``_log_bounds`` for one partition). If Kafka
        does not tell it, the high watermark ``high`` is taken, logged: as before the last
        stable offset was asked, records of a transaction open there are then skipped."""
        key = TopicPartition(*tp)
        try:
            found = self._background_admin().list_offsets(
                {key: OffsetSpec.latest()},
                isolation_level=IsolationLevel.READ_COMMITTED,
                request_timeout=15,
            )
            return int(next(iter(found.values())).result(timeout=20).offset)
        except Exception as exc:
            log.warning(
                "%s[%d]: its last stable offset is unknown (%s); starting at the log's end, "
                "%d: records of a transaction still open below it are not read",
                *tp,
                exc,
                high,
            )
            return high

    def _log_bounds(
        self, partitions: list[TopicPartition]
    ) -> dict[tuple[str, int], tuple[int, int]]:
        """Each partition's log start and last stable offset, in two requests for the whole
        assignment (one per leader) instead of a round trip per partition. The end is the
        last stable offset, not the high watermark: a job starting at a source's end with
        "latest" must not start past the records of a transaction still open there, which
        commit later. Partitions left out (a failed request) are asked alone."""
        if not partitions:
            return {}
        keys = [TopicPartition(tp.topic, tp.partition) for tp in partitions]
        try:
            admin = self._background_admin()
            starts = admin.list_offsets(
                {tp: OffsetSpec.earliest() for tp in keys}, request_timeout=15
            )
            ends = admin.list_offsets(
                {tp: OffsetSpec.latest() for tp in keys},
                isolation_level=IsolationLevel.READ_COMMITTED,
                request_timeout=15,
            )
        except (KafkaException, ValueError) as exc:
            log.info("reading the partitions' log bounds: %s", exc)
            return {}
        found: dict[tuple[str, int], list[int]] = defaultdict(list)
        for answers in (starts, ends):
            for tp, future in answers.items():
                try:
                    found[(tp.topic, tp.partition)].append(future.result(timeout=20).offset)
                except Exception as exc:
                    log.info("reading the log bounds of %s[%d]: %s", tp.topic, tp.partition, exc)
        return {key: (both[0], both[1]) for key, both in found.items() if len(both) == 2}

    def _checked_position(self, tp: tuple[str, int], offset: int, low: int, high: int) -> int:
        """``offset`` if the partition's log holds it, else a refusal naming what is missing
        (ConfigurationError: the supervisor stops every worker). Source records that retention
        deleted before the job read them go on from the log's start only with
        ``--skip-deleted-records``, logged and counted; a repartition topic's never (they
        were committed output of the stage before); a position past the log's end (a log
        truncated by an unclean leader election, a topic recreated) never either: the consumer
        would read the partition again from its start."""
        topic, partition = tp
        if offset > high:
            raise ConfigurationError(
                f"{topic}[{partition}]: the job's checkpoint continues at offset {offset}, but "
                f"the partition ends at {high} (its log was truncated by an unclean leader "
                "election, or the topic was deleted and created again): reading it again from "
                "its start would process records twice. If the topic was recreated, restart "
                "with --reset-state (its state starts empty, the sinks receive the output "
                "again) or run the job under a new name"
            )
        if offset >= low:
            return offset
        missing = low - offset
        if topic in self._repartitioned:
            raise ConfigurationError(
                f"repartition topic {topic}[{partition}] starts at offset {low}, but the job's "
                f"checkpoint continues at {offset}: {missing} records committed by the stage "
                "before were deleted (the topic's retention.ms/retention.bytes, or records "
                "deleted by hand). The job cannot continue exactly: restore a savepoint taken "
                "before, or restart with --reset-state"
            )
        if not self.settings.skip_deleted_records:
            raise ConfigurationError(
                f"source topic {topic}[{partition}] starts at offset {low}, but the job's "
                f"checkpoint continues at {offset}: {missing} records were deleted (the topic's "
                "retention.ms/retention.bytes) before the job read them. Nothing was skipped. "
                "Raise the topic's retention and produce those records again, or restart with "
                f"--skip-deleted-records to go on from offset {low} (the {missing} records are "
                "lost)"
            )
        log.error(
            "%s[%d]: %d records deleted before the job read them are skipped "
            "(--skip-deleted-records): going on from offset %d instead of %d",
            topic,
            partition,
            missing,
            low,
            offset,
        )
        self._event(
            {
                "event": "source_records_deleted",
                "topic": topic,
                "partition": partition,
                "from": offset,
                "to": low,
                "records": missing,
            }
        )
        return low

    def _check_lost_commit(
        self,
        task_id: str,
        ref: CheckpointRef,
        stored: list[CheckpointRef],
        committed: list[TopicPartition],
    ) -> CheckpointRef:
        """Kafka's committed offsets name ``ref``, but storage may record a newer checkpoint
        as committed: its worker wrote that marker only after Kafka acknowledged the commit
        of the checkpoint's transaction. If a fresh read of the offsets still names ``ref``,
        the broker lost part of an acknowledged transaction (a broker that restarts with
        the transaction still being completed can skip its markers: docs/exactly-once.md,
        "Known limits"); the records it made visible before are then produced again
        and sinks publish the replayed checkpoint again. Nothing here can repair that: it
        is reported loudly (log, metrics event, ``snapline_recoveries_total``) and the task
        restores what Kafka's offsets name, since its committed outputs follow them."""
        newer = [
            r
            for r in stored
            if r.checkpoint_id > ref.checkpoint_id
            and is_marked_committed(self.storage, self.pipeline.name, task_id, r)
        ]
        if not newer:
            return ref
        fresh, _ = self._read_again(task_id, committed)
        if fresh is not None and fresh.checkpoint_id >= newer[-1].checkpoint_id:
            # The first read was stale (another worker committed meanwhile): nothing lost.
            log.warning(
                "task %s: the committed offsets read named checkpoint %d, but checkpoint %d "
                "is marked committed: they were stale; now they name %d",
                task_id,
                ref.checkpoint_id,
                newer[-1].checkpoint_id,
                fresh.checkpoint_id,
            )
            return fresh
        log.error(
            "task %s: checkpoint %d was acknowledged as committed by Kafka (its marker is in "
            "storage), but the group's committed offsets name checkpoint %d: the broker lost "
            "the offsets of an acknowledged transaction. Restoring checkpoint %d; the input "
            "after it is processed again, so outputs of checkpoint %d that the broker did "
            "make visible appear twice. See docs/exactly-once.md, 'Known limits'.",
            task_id,
            newer[-1].checkpoint_id,
            (fresh or ref).checkpoint_id,
            (fresh or ref).checkpoint_id,
            newer[-1].checkpoint_id,
        )
        self._event(
            {
                "event": "kafka_lost_commit",
                "task": task_id,
                "acknowledged": [r.checkpoint_id for r in newer],
                "offsets_name": (fresh or ref).checkpoint_id,
            }
        )
        return fresh or ref

    def _missing_offsets(
        self, task_id: str, stored: list[CheckpointRef], offsets: list[TopicPartition]
    ) -> CheckpointRef | None:
        """The task has no committed offsets but stored checkpoints: if one of them is known
        to have committed, the offsets vanished (expired while the job was stopped, a topic
        recreated, another cluster's group of the same name): never guess silently.

        The offsets are read again first, after ``stored`` was listed: the first read may be
        stale (this worker froze after it, and the task's new owner has committed since), and
        then the checkpoints marked committed are that owner's, the fresh offsets name one,
        and it is restored as usual; nothing is deleted on the stale read."""
        committed = [
            r for r in stored if is_marked_committed(self.storage, self.pipeline.name, task_id, r)
        ]
        if not committed:
            return None  # only checkpoints that never committed: a fresh start is right
        fresh, _ = self._read_again(task_id, offsets)
        if fresh is not None:
            log.warning(
                "task %s: the committed offsets read had none, but checkpoint %d is marked "
                "committed: they were stale; now they name %d",
                task_id,
                committed[-1].checkpoint_id,
                fresh.checkpoint_id,
            )
            return fresh
        latest = committed[-1]
        choice = self.settings.on_missing_offsets
        where = self.storage.full_path(f"{self.pipeline.name}/tasks/{task_id}")
        if choice == "restore-latest":
            log.warning(
                "task %s: no committed offsets; restoring checkpoint %d, the newest known "
                "committed (--restore-latest). If a later checkpoint committed before its "
                "marker was written, its input is processed again.",
                task_id,
                latest.checkpoint_id,
            )
            return latest
        if choice == "reset-state":
            # Only checkpoints marked committed are deleted: they were listed before the
            # fresh read found no offsets, and a mark is written only after Kafka acknowledged
            # the commit, so none of them is the one a live owner's offsets name. One not
            # marked may be a checkpoint in flight on the task's owner (this worker may be a
            # zombie): retention deletes it once a checkpoint with a higher id commits.
            log.warning(
                "task %s: no committed offsets; --reset-state deletes its %d stored "
                "checkpoints marked committed and starts with empty state at the source's "
                "starting position",
                task_id,
                len(committed),
            )
            # Ids go on above the deleted ones, even if the job stops before its next
            # checkpoint is stored: the PostgreSQL sink's rows carry them (ID_FLOOR_FILE).
            raise_id_floor(self.storage, self.pipeline.name, stored[-1].checkpoint_id)
            self._publish_before_reset(task_id, latest)
            for ref in committed:
                delete_checkpoint(self.storage, self.pipeline.name, task_id, ref)
            self._reset_tasks.add(task_id)  # starts over: "latest" is now, for every partition
            if self._latest_at_start:  # and so for its later owners
                self._latest_at_start = self._latest_partitions_at_start(start_over=True)
            return None
        recreated = self._recreated_since(task_id, latest)
        if recreated:
            raise ConfigurationError(
                f"task {task_id}: topics {', '.join(recreated)} were deleted and "
                f"created again since its checkpoint {latest.checkpoint_id} (their ids "
                f"differ), and the consumer group {self.pipeline.name!r} lost its committed "
                "offsets with them. "
                "Nothing of the new topics was committed. Restart with --restore-latest "
                "--read-recreated-topics to go on from checkpoint "
                f"{latest.checkpoint_id} (the newest known committed) and read the new topics "
                "from their start with the job's state, with --reset-state to start over "
                "with empty state, or run the job under a new name."
            )
        raise CheckpointError(
            f"task {task_id}: the consumer group {self.pipeline.name!r} on "
            f"{self.settings.bootstrap_servers} has no committed offsets for its partitions, "
            f"but {where} holds committed checkpoints (newest: {latest.checkpoint_id}). The "
            "offsets may have expired while the job was stopped (offsets.retention.minutes), "
            "the source topic may have been recreated, or this is another cluster. Restart "
            "with --restore-latest to continue from checkpoint "
            f"{latest.checkpoint_id} (exact unless a newer checkpoint committed just before "
            "a crash, whose input would then be processed again), or with --reset-state to "
            "delete the stored checkpoints and start from the source's starting position "
            "(the sinks then receive the reprocessed output again)."
        )

    def _recreated_since(self, task_id: str, ref: CheckpointRef) -> list[str]:
        """The topics checkpoint ``ref`` read whose ids differ now (for the error message
        only: an unreadable checkpoint says nothing here; its restore reports it)."""
        try:
            meta = TaskCheckpoint.read(self.storage, self.pipeline.name, task_id, ref)
        except Exception as exc:
            log.info(
                "task %s: reading checkpoint %d's topic ids: %s", task_id, ref.checkpoint_id, exc
            )
            return []
        return self._changed_ids(meta)

    def _changed_ids(self, meta: TaskCheckpoint) -> list[str]:
        """The topics ``meta`` read whose ids differ from the ones read at this restore."""
        return recreated_since(meta.topic_ids, self._read_topic_ids)

    # ------------------------------------------------------------------ checkpoints
    def _on_task_snapshot(self, snapshot: TaskSnapshot) -> None:
        self.coordinator.acknowledge(snapshot)

    def _maybe_trigger(self, now: float) -> None:
        interval = self.pipeline.checkpoint_interval
        if self._first_after_restore:
            interval = min(interval, FIRST_CHECKPOINT_DELAY)
        if self.tasks and self.coordinator.pending is None and now - self._last_trigger >= interval:
            if self._nothing_read_since_trigger() and not any(
                task.time_pending for task in self.tasks.values()
            ):
                # Nothing read and no time moved (timers, watermarks) since the last
                # checkpoint: state, positions and output are unchanged, so an idle pipeline
                # writes no checkpoint files.
                if not self._first_after_restore:
                    self._last_trigger = now
                return
            self._trigger(now)

    def _trigger(self, now: float) -> None:
        self._first_after_restore = False
        n = self.coordinator.trigger(set(self.tasks))
        self._last_trigger = now
        self._start_id_check()
        self._records_at_trigger = self._records_in()
        for task in self.tasks.values():
            task.inject_barrier(n)

    def _complete(self, done: CompletedCheckpoint) -> None:
        """The commit point, then sink notification and retention."""
        n = done.checkpoint_id
        offsets = []
        for meta in done.tasks.values():
            for (topic, partition), offset in meta.positions.items():
                offsets.append(
                    TopicPartition(topic, partition, offset, metadata=meta.ref.offset_metadata())
                )
        self._check_read_topics(n)
        commit_start = time.monotonic()
        self._records_at_durable = self._records_in()
        if self.pipeline.exactly_once:
            self.output.commit(
                offsets,
                self.consumer.consumer_group_metadata(),
                offsets_sent=self._offsets_sent,
            )
        else:
            self._commit_at_least_once(offsets)
        committed_at = time.monotonic()
        self.faults.point("after_kafka_commit")
        self.coordinator.finish()
        keep = self.pipeline.retained_checkpoints
        for task_id, meta in done.tasks.items():
            task = self.tasks.get(task_id)
            if task is not None:
                task.notify_committed(n)
            self.coordinator.retain(task_id, meta.ref, keep)
            consumed = {tp: o for tp, o in meta.positions.items() if tp[0] in self._repartitioned}
            if consumed:
                history = self._repartition_positions.setdefault(task_id, [])
                history.append(consumed)
                del history[:-keep]
        self._delete_consumed_records()
        if self.pipeline.exactly_once and self.tasks:
            self.output.begin(self.coordinator.next_id)
        self._failures = 0
        self.checkpoints_committed += 1
        report_committed(self.checkpoints_committed)  # a healthy run, for a supervisor
        self._record_metrics(done, commit_start, committed_at)

    def _commit_at_least_once(self, offsets: list[TopicPartition]) -> None:
        """At-least-once's commit point: every output acknowledged, then the offsets. Its
        failures are the exactly-once commit's: an unreachable broker or coordinator is a
        BrokerOutageError (waited out, not counted), any other refusal (the member expired
        or the group rebalanced: UNKNOWN_MEMBER_ID, ILLEGAL_GENERATION, REBALANCE_IN_PROGRESS)
        a CheckpointError (the epoch is restored and read again); the commit is bounded like
        every consumer call. They escaped the checkpoint's handling and ended the worker
        (exit 75), and a flush that timed out in an outage counted as a failed checkpoint."""
        self.output.flush()  # BrokerOutageError when records wait past its bound
        try:
            self._consumer_call(
                "commit",
                20 + HANG_GRACE,
                lambda: self.consumer.commit(offsets=offsets, asynchronous=False),
            )
        except KafkaException as exc:
            error = kafka_error(exc)
            if error is not None and is_unavailable(error):
                raise BrokerOutageError(f"at-least-once commit: {error}") from exc
            raise CheckpointError(f"at-least-once commit of the offsets failed: {exc}") from exc

    def _delete_consumed_records(self) -> None:
        """Keep repartition topics small: delete the records every retained checkpoint of a
        task is past (a rewind to the oldest retained checkpoint still finds its input).
        At most every REPARTITION_DELETE_INTERVAL s; the request runs in the background and
        a failure only means the records are deleted next time."""
        now = time.monotonic()
        if (
            not self._repartition_positions
            or now - self._last_delete < REPARTITION_DELETE_INTERVAL
            or self._keep_repartition_records
        ):
            return
        self._last_delete = now
        keep = self.pipeline.retained_checkpoints
        below: list[TopicPartition] = []
        for task_id in list(self._repartition_positions):
            history = self._repartition_positions[task_id]
            if task_id not in self.tasks:
                del self._repartition_positions[task_id]
            elif len(history) >= keep:
                below += [TopicPartition(t, p, o) for (t, p), o in history[0].items() if o > 0]
        if not below:
            return
        # Only in the topics this worker's positions are offsets of: a worker frozen past its
        # session while a topic was deleted and created again (by hand, or by a restore that
        # lowered its partition count) would delete the new topic's unread records. The ids
        # are asked first (in the background too), then the records deleted. A restore that
        # keeps the topic empties it and its offsets go on, so such a delete that comes after
        # the id check (two steps: DeleteRecords addresses topics by name) deletes nothing
        # the restored job reads (restore._empty_repartition_topic).
        by_topic: dict[str, list[TopicPartition]] = {}
        for tp in below:
            by_topic.setdefault(tp.topic, []).append(tp)
        asked = time.monotonic()
        try:
            described = self._background_admin().describe_topics(
                TopicCollection(sorted(by_topic)), request_timeout=REPARTITION_ID_CHECK_BOUND
            )
        except (KafkaException, ValueError) as exc:
            log.warning("deleting consumed repartition records: %s", exc)
            return
        for topic, future in described.items():
            future.add_done_callback(self._delete_in_same_topic(topic, by_topic[topic], asked))

    def _start_id_check(self) -> None:
        """Ask for the ids of the topics the tasks read, after every record of the checkpoint
        just triggered was read (answered in the background; ``_check_read_topics``)."""
        topics = sorted(self._read_topic_ids)
        if not topics:
            self._id_check = None
            return
        try:
            self._id_check = self._background_admin().describe_topics(
                TopicCollection(topics), request_timeout=10
            )
        except (KafkaException, ValueError) as exc:
            self._id_check = exc

    def _check_read_topics(self, checkpoint_id: int) -> None:
        """Before checkpoint ``checkpoint_id`` commits: the topics its records came from are
        still the ones the tasks restored from. A topic deleted and created again while the
        worker ran (or was frozen) keeps its name, and the consumer goes on at the old
        offsets in the new log, skipping its first records. Then the checkpoint fails, and
        the tasks restore and meet the new id (``_recreated_topics``). A check that got no
        answer fails the checkpoint too."""
        check, self._id_check = self._id_check, None
        if not self._read_topics:
            return
        unknown = self._read_topics - set(self._read_topic_ids)
        if unknown:
            message = (
                f"checkpoint {checkpoint_id} does not commit: Kafka did not describe topics "
                f"{sorted(unknown)} when the tasks restored (unreachable, or the topics are "
                "gone), so records read from them cannot be checked to come from the topics "
                "the checkpoint's positions belong to"
            )
            # A broker that did not answer is waited out (the restore after it reads the ids
            # again); one that answers and still does not describe them counts.
            if not self._broker_reachable():
                raise BrokerOutageError(message)
            raise CheckpointError(message)
        if check is None or isinstance(check, Exception):
            raise CheckpointError(
                f"checkpoint {checkpoint_id}: asking Kafka for the ids of the topics it read "
                f"failed: {check or 'no request was made at its trigger'}"
            )
        changed = []
        deadline = time.monotonic() + 15.0
        for topic, future in check.items():
            try:
                found = self._described(topic, future, deadline)
            except Exception as exc:
                error = kafka_error(exc)
                if isinstance(exc, FutureTimeout) or (error is not None and is_unavailable(error)):
                    # Waited out like a commit that cannot reach the broker, not counted.
                    raise BrokerOutageError(
                        f"checkpoint {checkpoint_id}: could not read the id of topic {topic}: {exc}"
                    ) from exc
                raise CheckpointError(
                    f"checkpoint {checkpoint_id}: could not read the id of topic {topic}: {exc}"
                ) from exc
            if found is None:
                changed.append(f"{topic} (deleted)")
                continue
            expected = self._read_topic_ids.get(topic, "")
            if ids_differ(expected, topic_id(found)):
                changed.append(f"{topic} (id {expected}, now {topic_id(found)})")
        if changed:
            self._event({"event": "read_topic_recreated", "topics": changed})
            raise CheckpointError(
                f"checkpoint {checkpoint_id} does not commit: topics {', '.join(changed)} were "
                "deleted or created again since the tasks restored; they restore again"
            )

    def _described(self, topic: str, future: Any, deadline: float) -> Any | None:
        """The description ``future`` answers for ``topic`` (None: the topic does not exist).
        A topic one broker did not know (deleted, or that broker's metadata lags: it is
        restarting) is asked once more, a second later."""
        try:
            return future.result(timeout=max(0.1, deadline - time.monotonic()))
        except KafkaException as exc:
            if not _unknown_topic(exc):
                raise
        self.liveness.beat()
        time.sleep(1.0)
        try:
            return (
                self._background_admin()
                .describe_topics(TopicCollection([topic]), request_timeout=10)[topic]
                .result(timeout=15)
            )
        except KafkaException as exc:
            if not _unknown_topic(exc):
                raise
        return None

    def _topic_ids(self, topics: list[str], what: str = "repartition topics") -> dict[str, str]:
        """Topic name -> its id (``describe_topic_ids``): for repartition topics, the id seen
        at its first deletion is taken when Kafka gives none now; a task reading a topic
        without an id records none."""
        return describe_topic_ids(self._background_admin(), topics, what)

    def _delete_in_same_topic(self, topic: str, below: list[TopicPartition], asked: float) -> Any:
        """Callback of ``describe_topics`` (a librdkafka thread): delete the records below
        ``below`` if ``topic`` is still the one this worker started with, and the answer that
        says so is fresh: the check was ``asked`` (monotonic) at most
        ``REPARTITION_ID_CHECK_BOUND`` s ago.

        DeleteRecords names the topic, not its id, so the check and the deletion are two
        steps, and a process frozen between them (SIGSTOP, a paused VM) past its session
        timeout may wake after a restore deleted the topic and created it again (a lower
        partition count), whose offsets start at 0: its deletion would remove records in
        flight that the restored job has not read. Such a freeze lasts longer than the
        session timeout, hence than the bound, so the deletion is not sent then (the next
        round asks again). What is left is a freeze between the clock's read and the
        request's bytes leaving the process (librdkafka may first look up the partitions'
        leaders): librdkafka sends a request queued before a freeze once the process wakes,
        even past the request's timeout (seen: queued, frozen 20 s, sent and answered 0.3 s
        after the wake with a 10 s timeout). A restore never uses a repartition topic's
        name again (it replaces a topic whose partitions it must lower by one of a new name,
        ``stages.repartition_topic``, and keeps the offsets of a topic it keeps going on), so
        such a late deletion removes nothing the restored job reads."""

        def done(future: Any) -> None:
            try:
                found = topic_id(future.result())
            except Exception as exc:
                log.info("deleting consumed records of %s: %s", topic, exc)
                return
            known = self._repartition_topic_ids.setdefault(topic, found)
            if found != known:
                log.warning(
                    "repartition topic %s was created again since this worker started (by "
                    "hand, or by a savepoint restore that lowered its partition count while "
                    "this worker was frozen?): none of its records are "
                    "deleted by this worker, whose positions are offsets of the old topic",
                    topic,
                )
                return
            self.faults.point("before_repartition_delete")  # a librdkafka thread
            late = time.monotonic() - asked
            if late > REPARTITION_ID_CHECK_BOUND:
                log.warning(
                    "not deleting consumed records of %s: its id was checked %.0f s ago (was "
                    "this process frozen?); the topic may have been created again since",
                    topic,
                    late,
                )
                self.faults.point("repartition_delete_skipped")
                return
            self.faults.point("repartition_delete_fresh")
            try:
                futures = delete_records(
                    self._background_admin(), below, request_timeout=10, operation_timeout=0
                )
            except (KafkaException, ValueError) as exc:
                log.warning("deleting consumed repartition records: %s", exc)
                return
            for tp, deleted in futures.items():
                deleted.add_done_callback(_delete_done(tp, self.faults))

        return done

    def _background_admin(self) -> AdminClient:
        """The worker's long-lived admin client, for requests answered in the background."""
        if self._admin is None:
            self._admin = AdminClient(self._kafka_config)
        return self._admin

    def _read_position(self, tp: tuple[str, int]) -> int:
        """The consumer's position in ``tp`` (past transaction markers), or, before it has
        fetched anything there, the offset the partition's task starts from (-1: unknown)."""
        try:
            found = self.consumer.position([TopicPartition(tp[0], tp[1])])[0].offset
        except KafkaException:
            found = -1
        if found >= 0:
            return found
        task = self.tasks.get(task_id_for(self._stage_of_topic[tp[0]], tp[1]))
        channel = task.channels.get(tp) if task is not None else None
        return channel.next_offset if channel is not None else -1

    def _offsets_sent(self) -> None:
        self.faults.point("after_offsets_sent")

    def _record_metrics(
        self, done: CompletedCheckpoint, commit_start: float, committed_at: float
    ) -> None:
        entry = {
            "event": "checkpoint",
            "checkpoint": done.checkpoint_id,
            "tasks": len(done.tasks),
            "align_ms": round((done.aligned_at - done.triggered_at) * 1000, 2),
            "materialize_ms": round((done.durable_at - done.aligned_at) * 1000, 2),
            "commit_ms": round((committed_at - commit_start) * 1000, 2),
            "total_ms": round((time.monotonic() - done.triggered_at) * 1000, 2),
            "state_bytes": sum(
                f.size for m in done.tasks.values() if m.state for f in m.state.files
            ),
            "records_in": self._records_in(),
            # Records read while this checkpoint was aligning and materializing: processing
            # does not stop for a snapshot.
            "records_during_checkpoint": self._records_at_durable - self._records_at_trigger,
            "alignment_blocks": sum(t.aligner.blocked_count for t in self.tasks.values()),
        }
        log.info(
            "checkpoint %(checkpoint)d committed: align %(align_ms)sms, materialize "
            "%(materialize_ms)sms, commit %(commit_ms)sms",
            entry,
        )
        self._event(entry)
        self.metrics.checkpoint_completed(done, committed_at - commit_start)

    def _records_in(self) -> int:
        return sum(t.records_in for t in self.tasks.values())

    def _nothing_read_since_trigger(self) -> bool:
        """State, positions and output are those of the last checkpoint triggered."""
        return self._records_in() == self._records_at_trigger

    def _event(self, entry: dict[str, Any]) -> None:
        """Append a metrics event (JSON line) when SNAPLINE_METRICS_FILE is set; feed the
        Prometheus metrics and the checkpoint history. Text in it (a failure's reason can
        quote a checkpoint URI) is redacted: the history is written to checkpoint storage."""
        entry = {k: redact_text(v) if isinstance(v, str) else v for k, v in entry.items()}
        self.metrics.on_event(entry, self.coordinator.pending)
        if self._metrics_path:
            entry = {
                **entry,
                "worker": self.settings.worker_id,
                "pid": os.getpid(),
                "time": time.time(),
            }
            with open(self._metrics_path, "a") as fh:
                fh.write(json.dumps(entry) + "\n")

    def _count_failure(self, exc: Exception) -> None:
        """One more checkpoint failed in a row; past the tolerance the worker stops. A broker
        outage is waited out (_fail_checkpoint), not held against the job."""
        self._quiet_since = time.monotonic()  # not a quiet run (supervisor)
        if not isinstance(exc, BrokerOutageError):
            self._failures += 1
        log.error("checkpoint failed (%d in a row): %s", self._failures, exc)
        tolerable = self.pipeline.tolerable_failed_checkpoints
        if self._failures > tolerable:
            raise CheckpointError(
                f"{self._failures} checkpoints failed in a row (tolerable_failed_checkpoints="
                f"{tolerable}); last error: {exc}"
            ) from exc

    def _continue_epoch(self, exc: CheckpointStorageError) -> None:
        """Checkpoint storage refused the checkpoint, but every sink pre-committed and the
        Kafka transaction is intact: processing goes on, and the next checkpoint commits this
        epoch together with the next one. The half-written checkpoint is never named by a
        commit; retention deletes it once a later one commits."""
        self._count_failure(exc)
        log.warning(
            "checkpoint storage failed; processing continues and the next checkpoint takes "
            "this epoch too (%d of %d tolerable failures in a row)",
            self._failures,
            self.pipeline.tolerable_failed_checkpoints,
        )
        self.coordinator.cancel()
        # The open epoch has uncommitted work even if nothing more is read: the idle check
        # must not skip the next trigger.
        self._records_at_trigger = -1
        if self.tasks:
            self.output.continue_epoch(self.coordinator.next_id)

    def _fail_checkpoint(self, exc: Exception) -> None:
        """Abort the epoch and restore every task from its committed checkpoint."""
        if isinstance(exc, FencedError):
            # Before the failure counts: a superseded worker stops with exit 79, not with a
            # "too many failed checkpoints" exit 1 that its supervisor restarts.
            self._check_incarnation("producer was fenced")
        self._count_failure(exc)
        if "MSG_SIZE_TOO_LARGE" in str(exc) or isinstance(exc, TransactionFailedError):
            # The broker refused a batch as too large (a failed commit says so; a produce
            # into the failed transaction only says "Erroneous state"): a topic's limit may
            # have been lowered.
            self._reread_record_limits()
        if isinstance(exc, BrokerOutageError):
            self._await_broker(exc)
        else:
            sleep_unless(lambda: self._stopping, min(0.5 * 2**self._failures, 10))
        self._drop_tasks()
        self._restore_pending = True

    def _reread_record_limits(self) -> None:
        """After a checkpoint failed on a refused batch: when a topic's ``max.message.bytes``
        was lowered since the worker read it, the broker refuses batches over it and every
        retry of the epoch would fail. Read the limits again; the producer gets new ones, so
        the restored epoch's records fit its batches, and a record over them goes to the dead
        letters (``Task._fits``). Kafka config that sets a limit above the topic's ends the
        worker with the fix (ConfigurationError), as at start."""
        from snapline.pipeline.runtime.topics import TopicManager

        found = self._record_limits(
            TopicManager(self._kafka_config, self.settings.bootstrap_servers)
        )
        if found is None:
            return
        topic, limit, limits = found
        if self.output.resize(limits):
            log.warning(
                "topic %s now accepts record batches of at most %d bytes: producer %s",
                topic,
                limit,
                ", ".join(f"{k}={v}" for k, v in limits.items()),
            )

    def _record_limits(self, manager: Any) -> tuple[str, int, dict[str, int]] | None:
        """The topic the job writes with the smallest ``max.message.bytes``, that limit, and
        the producer settings that keep record batches within it
        (``topics.producer_size_limits``); None when the cluster does not say or the
        producer's defaults fit. ``manager``: a ``topics.TopicManager``."""
        from snapline.pipeline.runtime.topics import pipeline_topics, producer_size_limits

        smallest = manager.smallest_record_limit(pipeline_topics(self.pipeline))
        if smallest is None:
            return None
        limits = producer_size_limits(self._kafka_config, *smallest)
        return (smallest[0], smallest[1], limits) if limits else None

    def _restore_after_failure(self) -> None:
        """Rebuild the tasks of the partitions this worker still owns.

        Runs one consumer poll first: a worker whose checkpoint failed because it lost its
        partitions (a zombie) learns so there (the rebalance callbacks run, and on_assign
        restores whatever it owns now), instead of re-running recovery on partitions that
        belong to another worker. Messages fetched meanwhile are dropped: every partition is
        sought to its restored position below (or, when a callback rebuilt the tasks during
        the poll, by ``_consume``, which rewinds to the new tasks' positions)."""
        self._consume(0.2)
        if not self._restore_pending:
            return  # a rebalance callback rebuilt the tasks
        self._restore_pending = False
        assignment = self.consumer.assignment()
        started = time.monotonic()
        restored = self._restore(assignment)
        self._event(
            {
                # Not "restored" (tests read that one as the restore of an assignment).
                "event": "restored_after_failure",
                "seconds": round(time.monotonic() - started, 3),
                "checkpoints": self._restored_from,
                "bytes": self._restored_bytes,
                "reason": "after a failed checkpoint",
            }
        )
        for (topic, partition), offset in restored.items():
            self.consumer.seek(TopicPartition(topic, partition, offset))

    def _broker_reachable(self, fresh_client: bool = False, timeout: float = 2.0) -> bool:
        """The broker answers a metadata request and every source partition has a leader.

        Asked through the worker's consumer, or with ``fresh_client`` through a new admin
        client, when the consumer itself is suspect (it stays outside its group: in a bounce
        test run, one that asked that consumer was never replaced)."""
        topics = self.pipeline.source_topics()
        try:
            if fresh_client:
                call = BoundedCall("admin", self.liveness)
                try:
                    metadata = self._with_fresh_admin(
                        lambda admin: call(
                            "list_topics", 5 + HANG_GRACE, admin.list_topics, None, 5
                        )
                    )
                except KafkaClientError:  # hung: this admin client is dropped anyway
                    return False
            else:
                metadata = self._consumer_call(
                    "list_topics", timeout + HANG_GRACE, self.consumer.list_topics, None, timeout
                )
        except KafkaException:
            return False
        for name in topics:
            topic = metadata.topics.get(name)
            if topic is None or topic.error is not None:
                return False
            if any(p.leader < 0 for p in topic.partitions.values()):
                return False
        return True

    def _await_broker(self, exc: Exception) -> None:
        """Wait (up to BROKER_OUTAGE_LIMIT, or until a stop) until the broker answers again.

        Raises ConsumerStuckError (the run loop replaces the consumer) when a fresh client
        reaches the cluster while the consumer has not for CONSUMER_BLIND_AFTER."""
        started = time.monotonic()
        self._event({"event": "broker_unavailable", "error": str(exc)[:300]})
        attempt = 0
        last_log = started
        ask_fresh_client = started + CONSUMER_BLIND_AFTER
        while not self._broker_reachable():
            self.liveness.beat()  # a wait that BROKER_OUTAGE_LIMIT bounds
            waited = time.monotonic() - started
            if self._stopping:
                raise _StopNow(f"stop requested while the broker is unreachable ({exc})")
            if time.monotonic() >= ask_fresh_client:
                # A bounce test's worker asked its consumer for 200 s after the cluster came
                # back (its peer committed all along): the consumer never saw the broker again.
                # The consumer is asked once more with the fresh client's 5 s: a slow answer
                # is not a stuck consumer.
                if self._broker_reachable(fresh_client=True):
                    if self._broker_reachable(timeout=5.0):
                        break
                    raise ConsumerStuckError(
                        f"a new client reaches the broker, but this worker's consumer has not "
                        f"for {waited:.0f}s since the outage ({exc})"
                    )
                ask_fresh_client = time.monotonic() + CONSUMER_BLIND_AFTER
            if waited > BROKER_OUTAGE_LIMIT:
                raise KafkaClientError(
                    f"Kafka at {self.settings.bootstrap_servers} unreachable for "
                    f"{waited:.0f}s (limit {BROKER_OUTAGE_LIMIT:.0f}s); last error: {exc}"
                )
            if time.monotonic() - last_log > 30:
                log.warning("broker still unreachable after %.0fs; waiting", waited)
                last_log = time.monotonic()
            sleep_unless(lambda: self._stopping, backoff(attempt, cap=2.0))
            attempt += 1
        waited = time.monotonic() - started
        log.warning("broker reachable again after %.1fs; aborting the epoch and restoring", waited)
        self._event({"event": "broker_back", "waited": round(waited, 3)})

    def _with_fresh_admin(self, use: Callable[[AdminClient], T]) -> T:
        """``use`` a new admin client, dropped afterwards on a helper thread (librdkafka's
        destructor may block while the broker is gone)."""
        holder: list[AdminClient] = [AdminClient(self._kafka_config)]
        try:
            return use(holder[0])
        finally:
            release_in_background(holder)

    def _broker_answers_fresh_client(self) -> bool:
        if self._broker_reachable(fresh_client=True):
            return True
        log.info("the consumer looks stuck, but the broker does not answer: waiting")
        return False

    def _task_partitions(self) -> list[TopicPartition]:
        return [
            TopicPartition(topic, partition)
            for task in self.tasks.values()
            for topic, partition in task.channels
        ]

    def _records_waiting(self) -> int:
        """Committed records past the consumer's positions in the tasks' partitions, by the
        partitions' ends as a fresh admin client reads them (0 when it cannot tell)."""
        try:
            positions = {
                (tp.topic, tp.partition): tp.offset
                for tp in self.consumer.position(self._task_partitions())  # local, no request
                if tp.offset >= 0
            }
        except KafkaException:  # e.g. the partitions moved meanwhile
            return 0
        if not positions:
            return 0
        request = {TopicPartition(t, p): OffsetSpec.latest() for t, p in positions}

        def ends_of(admin: AdminClient) -> dict[tuple[str, int], int]:
            found = admin.list_offsets(
                request, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=5
            )
            return {
                (tp.topic, tp.partition): f.result(timeout=10).offset for tp, f in found.items()
            }

        try:
            ends = self._with_fresh_admin(ends_of)
        except (KafkaException, FutureTimeout):
            return 0
        return sum(max(0, ends[key] - position) for key, position in positions.items())

    def _register_incarnation(self) -> None:
        """Mark this process as the newest of its worker id (runtime/incarnation.py); it may
        wait up to a session timeout and a margin for another host's holder of the id to
        leave the group, or stop (SupersededError, exit 79)."""
        wait = self._holder_wait()

        def is_member() -> bool | None:
            self.liveness.allow(MEMBERSHIP_READ_BOUND)
            return departed.is_member(
                self._kafka_config, self.pipeline.name, self.settings.worker_id
            )

        try:
            self.incarnation = incarnation.register(
                self.storage,
                self.pipeline.name,
                self.settings.worker_id,
                self.local_dir / f"{self.pipeline.name}.incarnation",
                is_member,
                wait,
                stopping=lambda: self._stopping,
            )
        except incarnation.StopRequested:
            raise _StopNow("stopped while waiting for the worker id's holder to leave") from None

    def _check_incarnation(self, what: str) -> None:
        """Before a client is replaced: SupersededError (exit 79) if a later process with this
        worker id registered since this one and holds its membership of the group; a later
        mark whose process does not join within a session timeout and a margin is taken for
        a dead one's (runtime/incarnation.py)."""
        if self.incarnation is None:
            return
        job, worker_id = self.pipeline.name, self.settings.worker_id
        wait = self._holder_wait()

        def holder_joined() -> bool | None:
            self.liveness.allow(MEMBERSHIP_READ_BOUND)  # asked only for another's mark
            try:
                mine = self.consumer.memberid() or None
            except (RuntimeError, AttributeError):  # closed, or not built yet
                mine = None
            return departed.held_by_another(self._kafka_config, job, worker_id, mine)

        try:
            incarnation.check_current(
                self.storage,
                job,
                worker_id,
                self.incarnation,
                what,
                holder_joined,
                wait,
                stopping=lambda: self._stopping,
            )
        except incarnation.StopRequested:
            raise _StopNow("stopped while waiting for the worker id's new holder") from None

    def _holder_wait(self) -> float:
        """How long another holder of the worker id may take to show in the group: a session
        timeout (a holder being stopped stays a member for up to its STOP_BOUND) and a
        margin."""
        return float(self._consumer_config()["session.timeout.ms"]) / 1000 + STOP_BOUND + 5

    def _replace_consumer(self, exc: KafkaClientError) -> None:
        """A fresh consumer (same group.instance.id) instead of one that failed fatally.

        The epoch is aborted first: nothing read under the old membership may commit. The new
        consumer joins the group, replacing the stale static member, and its assignment
        restores the tasks from the committed checkpoint (_on_assign)."""
        self._check_incarnation(
            "consumer was fenced"
            if isinstance(exc, ConsumerFencedError)
            else "consumer stopped working and is to be replaced"
        )
        now = time.monotonic()
        self._consumer_replaced = [t for t in self._consumer_replaced if now - t < 600] + [now]
        if len(self._consumer_replaced) > MAX_CONSUMER_REPLACEMENTS:
            raise KafkaClientError(
                f"{exc}; the consumer was replaced {MAX_CONSUMER_REPLACEMENTS} times in 10 "
                "minutes: does another live worker use the id "
                f"{self.settings.worker_id!r}?"
            ) from exc
        log.warning("%s; replacing the consumer", exc)
        self._event({"event": "consumer_replaced", "error": str(exc)[:300]})
        self._drop_tasks()
        old = self.consumer
        try:
            self._consumer_call("close", 10.0, old.close)
        except Exception as close_exc:  # a fenced consumer may fail to close; it is dropped
            log.warning("closing the fenced consumer: %s", close_exc)
        self._consumer_call = BoundedCall("consumer", self.liveness, inline=self._in_callback)
        self._consumer_fatal = None
        self.consumer = self._new_consumer()
        self._subscribe()
        self._assigned = False
        self._watch.unassigned()
        holder: list[object] = [old]
        del old
        release_in_background(holder)

    def _new_consumer(self) -> Consumer:
        try:
            return Consumer({**self._consumer_config(), "error_cb": self._on_consumer_error})
        except KafkaException as exc:
            raise invalid_kafka_settings(exc, "consumer") from exc

    def _on_consumer_error(self, error: KafkaError) -> None:
        """librdkafka's error callback (runs inside consume on the task thread)."""
        if classify(error) is ErrorClass.FATAL:
            self._consumer_fatal = str(error)
        log.warning("kafka consumer: %s", error)

    def _subscribe(self) -> None:
        self.consumer.subscribe(
            self.plan.input_topics(self.pipeline.source_topics()),
            on_assign=self._guarded(self._on_assign),
            on_revoke=self._guarded(self._on_revoke),
            on_lost=self._guarded(self._on_lost),
        )

    # ------------------------------------------------------------------ main loop
    def request_stop(self, *_: Any) -> None:
        """SIGTERM/SIGINT: final checkpoint if possible; the process ends within STOP_BOUND s
        whatever the broker does (the stop timer exits without the final checkpoint)."""
        if self._stopping:
            return
        self._stopping = True
        self.output.commit_timeout = FINAL_CHECKPOINT_BOUND / 2
        self.output.abort_timeout = 3.0
        timer = threading.Timer(STOP_BOUND - 2.0, _exit_after_stop_bound)
        timer.daemon = True
        timer.start()

    def run(self, *, max_seconds: float | None = None) -> None:
        """Process until stopped (SIGTERM: final checkpoint, clean exit).

        Raises KafkaClientError (exit EX_TEMPFAIL) when a Kafka client cannot go on."""
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        try:
            # Startup phases as events (the recovery benchmark splits restart time by them).
            self._event({"event": "started"})
            self._register_incarnation()
            self.output.init()
            self._event({"event": "transactions_ready"})
            self._subscribe()
            self._watch.unassigned()  # the limit counts from the subscription
            while True:
                self.liveness.beat()
                if self._exit_after_savepoint:
                    log.info("stopped with a savepoint: exiting")
                    break
                if self._stopping or (deadline is not None and time.monotonic() > deadline):
                    self._final_checkpoint()
                    break
                try:
                    if self._outage is not None:
                        # The broker went away while restoring: wait for it, restore again.
                        outage, self._outage = self._outage, None
                        self._fail_checkpoint(outage)
                    else:
                        self._step()
                except BrokerOutageError as exc:
                    self._outage = exc
                except (ConsumerFencedError, ConsumerStuckError) as exc:
                    self._replace_consumer(exc)
        except _StopNow as exc:
            self.output.abort_timeout = 1.0  # the successor's init_transactions aborts it
            log.warning(
                "%s: exiting without a final checkpoint; recovery restores the last "
                "committed checkpoint",
                exc,
            )
        except FencedError:
            log.error(
                "the producer of worker %s failed fatally (fenced by another incarnation, or "
                "its epoch bumped by the broker); exiting",
                self.settings.worker_id,
            )
            raise
        except KafkaException as exc:
            # Raised out of a rebalance callback or a client call: the clients are in an
            # unknown state; a restarted worker recovers from the committed checkpoint. Where
            # it came from goes to the log: no call is expected to raise this far.
            log.error("Kafka client error out of the worker loop", exc_info=exc)
            raise KafkaClientError(f"Kafka client error: {exc}") from exc
        finally:
            self._close()

    def _report_idle_healthy(self, now: float) -> None:
        """Once per run, for a supervisor: healthy after ``_idle_healthy_after`` seconds with
        no checkpoint failing, restores' time not counted (``_quiet_since``; a worker that
        commits reports at its first commit instead)."""
        after = self._idle_healthy_after
        if after is not None and now - self._quiet_since >= after:
            self._idle_healthy_after = None
            report_idle_healthy()

    def _check_coverage(self, now: float) -> None:
        """Once after each assignment, when a checkpoint committed under it: are partitions
        the job reads assigned to no worker (a static member's restart hid them,
        runtime/coverage.py)? The check runs in a daemon thread; when it found some, this
        worker subscribes again, and the group's leader's rejoin rebalances the group."""
        due = self._coverage_due
        if (
            due is not None
            and now >= due[0]
            and self.checkpoints_committed > due[1]
            and self._outage is None
        ):
            self._coverage_due = None
            assignment = self._assignments
            topics = self.plan.input_topics(self.pipeline.source_topics())

            def check() -> None:
                try:
                    missing = coverage.unassigned_partitions(
                        self._kafka_config, self.pipeline.name, topics
                    )
                except Exception as exc:  # a courtesy check: the next assignment checks again
                    log.info("could not compare the group's assignment with the topics: %s", exc)
                    return
                if missing:
                    self._uncovered = (assignment, missing)

            threading.Thread(target=check, name="coverage-check", daemon=True).start()
        uncovered = self._uncovered
        if uncovered is None or uncovered[0] != self._assignments:
            return  # nothing found, or a rebalance came since the check
        if self._paused is not None or self._savepoint_request is not None:
            return  # after the savepoint
        self._uncovered = None
        missing = uncovered[1]
        names = ", ".join(f"{t}[{p}]" for t, p in missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        self._coverage_rejoins = [t for t in self._coverage_rejoins if now - t < 600]
        if len(self._coverage_rejoins) >= MAX_COVERAGE_REJOINS:
            log.error(
                "partitions %s belong to no worker of group %s after %d rejoins in 10 minutes: "
                "nothing reads them. Restart the workers one at a time, each down for longer "
                "than session.timeout.ms, so that the group rebalances",
                names,
                self.pipeline.name,
                MAX_COVERAGE_REJOINS,
            )
            return
        self._coverage_rejoins.append(now)
        log.warning(
            "partitions %s belong to no worker of group %s: partitions were added while a "
            "worker restarted within the session timeout, and the group kept its old "
            "assignment (KAFKA-13435). Joining the group again, so that it rebalances",
            names,
            self.pipeline.name,
        )
        self._event({"event": "rejoined_for_unassigned", "partitions": len(missing)})
        self._subscribe()

    def _step(self) -> None:
        self._poll_control()
        if self._restore_pending:
            self._restore_after_failure()
            return
        pending = self.coordinator.pending
        held = self.output.held
        messages = None
        if held < MAX_HELD_RECORDS:
            messages = self._consume(0.005 if pending else 0.05)
            if messages:
                self._route(messages)
        else:
            time.sleep(0.002)
        now = time.monotonic()
        if messages:
            self._watch.fetched(now)
        self._check_coverage(now)
        self._report_idle_healthy(now)
        self._watch.check(
            now,
            bool(self.tasks) and self._paused is None and held < MAX_HELD_RECORDS,
            self._broker_answers_fresh_client,
            self._records_waiting,
        )
        # Paused for a savepoint: time stands still too. Timers and idleness would otherwise
        # fire windows and commit checkpoints whose output lands in the repartition topics
        # the savepoint copies, while its state is the paused one's (fired twice on restore).
        paused = self._paused is not None
        if not paused:
            self._maybe_trigger(now)
        try:
            if not paused:
                for task in self.tasks.values():
                    task.run()
            self.output.poll()
        except (FencedError, TransactionFailedError) as exc:
            # The producer was fenced, or its transaction failed, while the epoch ran: the
            # abort ends the transaction (replacing a fenced producer) and the tasks restore
            # from the committed checkpoint, as after a failed commit.
            self._event({"event": "checkpoint_failed", "error": redact_text(str(exc))[:500]})
            self._fail_checkpoint(exc)
            return
        self.metrics.maybe_sample(self.tasks, self.output.held, self.consumer)
        if self.coordinator.pending is not None:
            try:
                done = self.coordinator.poll()
                if done is not None:
                    self._complete(done)
            except CheckpointStorageError as exc:  # raised by poll only: before the commit point
                self._event(
                    {
                        "event": "checkpoint_failed",
                        "error": redact_text(str(exc))[:500],
                        "continued": True,
                        "records_in": self._records_in(),
                    }
                )
                self._continue_epoch(exc)
            except CheckpointError as exc:
                # FencedError too: the abort replaces the producer; a fenced consumer is
                # replaced on its next poll (_route).
                self._event({"event": "checkpoint_failed", "error": redact_text(str(exc))[:500]})
                self._fail_checkpoint(exc)

    def _in_callback(self) -> bool:
        return self._callback_thread == threading.get_ident()

    def _guarded(self, callback: Any) -> Any:
        """A rebalance callback whose exception is re-raised by ``_consume`` after the poll
        returns: librdkafka may run further callbacks in the same poll, and an exception
        left pending across them surfaces as an unrelated SystemError."""

        def run(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            self._rebalances += 1
            if self._callback_error is not None:
                return  # an earlier callback of this poll failed; the worker is stopping
            self._callback_thread = threading.get_ident()
            try:
                callback(consumer, partitions)
            except Exception as exc:
                self._callback_error = exc
            finally:
                self._callback_thread = None

        return run

    def _out_of_range(self, msg: Any) -> int | None:
        """Where to fetch a partition from after the consumer's fetch left its log while the
        job ran: records were deleted before it fetched them (it lags behind retention), or
        the log was truncated. The same decision as at a restore (``_checked_position``): a
        refusal, or with ``--skip-deleted-records`` the log's start. None: not a partition of
        this worker's tasks (any more)."""
        tp = (msg.topic(), msg.partition())
        task = self.tasks.get(task_id_for(self._stage_of_topic[tp[0]], tp[1]))
        channel = task.channels.get(tp) if task is not None else None
        if channel is None:
            return None
        # The offset whose fetch failed. An error below the task's position is stale: a fetch
        # of an earlier assignment (a zombie's, before the rebalance that restored the task:
        # the new owner has deleted those records since), answered in the same poll.
        failed = msg.offset() if msg.offset() >= 0 else channel.next_offset
        if failed < channel.next_offset:
            log.info(
                "%s[%d]: a fetch at %d (before the task's position %d) was out of range: "
                "fetching on from the task's position",
                *tp,
                failed,
                channel.next_offset,
            )
            return channel.next_offset
        try:
            low, high = self.consumer.get_watermark_offsets(TopicPartition(*tp), timeout=30)
        except KafkaException as exc:  # a broker outage: the next fetch tells again
            log.warning("%s[%d]: cannot read the log's offsets (%s)", *tp, exc)
            return failed
        return self._checked_position(tp, failed, low, high)

    def _fetch_from(self, targets: dict[tuple[str, int], int]) -> None:
        """Fetch again after errors stopped partitions (``targets``: where from). A partition in
        that state refuses a seek (_STATE), so every partition of the tasks is assigned again,
        the others at their task's position: what the poll returned is dropped by the caller
        and fetched again, in order."""
        positions = [
            TopicPartition(t, p, targets.get((t, p), channel.next_offset))
            for task in self.tasks.values()
            for (t, p), channel in task.channels.items()
        ]
        self.consumer.assign(positions)
        if self._paused is not None:
            self.consumer.pause(positions)

    def _consume(self, timeout: float) -> list[Any]:
        rebalances = self._rebalances
        messages = self.consumer.consume(BATCH_SIZE, timeout)
        error, self._callback_error = self._callback_error, None
        if error is not None:
            raise error
        if self._consumer_fatal is not None:
            raise ConsumerFencedError(f"consumer failed fatally: {self._consumer_fatal}")
        # Checked here, not in _route: a poll whose messages are dropped (after a failed
        # checkpoint) must not swallow the one event that says the consumer is dead.
        events = False
        refetch: dict[tuple[str, int], int] = {}
        for msg in messages:
            error = msg.error()
            if error is not None:
                if error.code() in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
                    target = self._out_of_range(msg)
                    if target is not None:
                        refetch[(msg.topic(), msg.partition())] = target
                    continue
                if classify(error) is ErrorClass.FATAL:
                    # e.g. "Static consumer fenced by other consumer with same
                    # group.instance.id" after a broker outage longer than session.timeout.ms
                    raise ConsumerFencedError(f"consumer failed fatally: {error}")
                log.warning("consumer: %s", error)
                events = True
        if refetch:  # the whole poll is fetched again, from the tasks' positions
            self._fetch_from(refetch)
            return []
        if events:  # only records go on: what the poll returned besides them is logged
            messages = [msg for msg in messages if msg.error() is None]
        if messages and self._rebalances != rebalances:
            # A rebalance callback rebuilt (or dropped) the tasks during this poll. The batch
            # can hold messages fetched under the old assignment, which the new tasks must
            # not take (they would skip ahead), and messages of the new assignment, which a
            # caller that drops this batch (_restore_after_failure) would lose for good: the
            # consumer's position is already past them. Drop the batch and rewind every
            # partition to its task's position; each message is fetched again, in order.
            self._rewind_to_tasks()
            return []
        return messages

    def _rewind_to_tasks(self) -> None:
        """Seek every partition of the tasks to the next offset its task expects."""
        positions = [
            TopicPartition(topic, partition, channel.next_offset)
            for task in self.tasks.values()
            for (topic, partition), channel in task.channels.items()
        ]
        try:
            for tp in positions:
                self.consumer.seek(tp)
        except KafkaException as exc:
            # seek needs an active fetcher; assigning the same partitions with offsets
            # always sets the positions.
            log.warning("seek after a rebalance failed (%s); assigning the positions", exc)
            self._fetch_from({})

    def _route(self, messages: list[Any]) -> None:
        """Hand the records of one poll (``_consume``'s: no error events) to their tasks'
        channels, in order per partition. A poll returns a partition's records in runs
        (mostly one run per poll), so the group is looked up once per run."""
        groups: dict[tuple[str, int], list[Any]] = {}
        topic, partition = "", -1
        group: list[Any] = []
        for msg in messages:
            p, t = msg.partition(), msg.topic()
            if p != partition or t != topic:
                topic, partition = t, p
                group = groups.setdefault((t, p), [])
            group.append(msg)
        for (topic, partition), batch in groups.items():
            task = self.tasks.get(task_id_for(self._stage_of_topic[topic], partition))
            if task is None or (topic, partition) not in task.channels:
                continue  # fetched before a revoke; the new owner reads it again
            task.enqueue((topic, partition), batch)

    def _final_checkpoint(self, reason: str = "stop") -> bool:
        """Checkpoint and commit everything read so far (SIGTERM, partitions revoked, a
        savepoint); True when everything read is committed."""
        if not self.tasks:
            return True
        if (
            self.coordinator.pending is None
            and self._nothing_read_since_trigger()
            and not any(task.time_pending for task in self.tasks.values())
        ):
            if reason == "stop":
                log.info(
                    "stop: nothing read since checkpoint %d; no final checkpoint needed",
                    self.coordinator.next_id - 1,
                )
            return True  # nothing read since the last committed checkpoint
        log.info("%s: taking a final checkpoint", reason)
        bound = self.pipeline.checkpoint_timeout
        if self._stopping:  # SIGTERM: the process must end within STOP_BOUND
            bound = min(bound, FINAL_CHECKPOINT_BOUND)
        deadline = time.monotonic() + bound
        target = None
        # A savepoint's: time stands still from here on. A timer fired, or a watermark moved
        # by idleness, once the barrier passed would put output into the next epoch, whose
        # transaction then stays open while the job pauses: the savepoint's read of the
        # records in flight waited for it until the broker aborted it (transaction.timeout.ms),
        # and the worker's next commit failed. They fire after the resume.
        advance_time = reason != "savepoint"
        while time.monotonic() < deadline:
            if self.coordinator.pending is None:
                if target is not None and self.coordinator.next_id > target:
                    return True
                target = self.coordinator.next_id
                self._trigger(time.monotonic())
            try:
                for task in self.tasks.values():
                    task.run(advance_time)
                self.output.poll()
                done = self.coordinator.poll()
                if done is not None:
                    self._complete(done)
            except CheckpointError as exc:
                # FencedError and TransactionFailedError too (also out of task.run): the abort
                # that follows ends the transaction, replacing a fenced producer
                log.error("%s: final checkpoint failed (the epoch is aborted): %s", reason, exc)
                self._event({"event": "checkpoint_failed", "error": redact_text(str(exc))[:500]})
                return False
            if done is not None and done.checkpoint_id == target:
                log.info("%s: final checkpoint %d committed", reason, target)
                return True
            # A turn of a loop bounded by ``bound`` (up to checkpoint_timeout, 600 s): a large
            # materialization on a revoke or for a savepoint is no stall of the task thread
            # (the watchdog ended it at the liveness timeout, 180 s, on every attempt).
            self.liveness.beat()
            time.sleep(0.001)
        return False

    # ------------------------------------------------------------------ savepoints
    def _poll_control(self) -> None:
        """Savepoint requests and resumes from the control channel (savepoint/control.py)."""
        for request in self._control.poll():
            if request.action == "savepoint":
                self._savepoint_request = request
            elif request.action == "resume" and self._paused and self._paused[0] == request.id:
                self._resume("the savepoint is written")
            elif (
                request.action == "resume"
                and self._savepoint_request is not None
                and self._savepoint_request.id == request.id
            ):
                # Found in progress at start, written before this worker had its tasks: not
                # taken, and the partitions paused at the assignment go on (_on_assign).
                log.info("savepoint %s was written before this worker took part", request.id)
                self._savepoint_request = None
                if self._paused is None:
                    self.consumer.resume(self.consumer.assignment())
            elif (
                request.action == "hold"
                and self._paused
                and self._paused[0] == request.id
                and time.monotonic() - self._paused_at < MAX_PAUSE
            ):
                self._paused = (request.id, time.monotonic())  # still being written
        waiting = self._savepoint_request
        if waiting is not None and self._assigned and not self._restore_pending:
            self._savepoint_request = None
            self._take_savepoint(waiting)
        limit = self._pause_limit
        if self._paused is not None and time.monotonic() - self._paused[1] > limit:
            if time.monotonic() - self._paused_at >= MAX_PAUSE:
                self._resume(f"paused for {MAX_PAUSE:.0f}s, the longest a savepoint may hold it")
            else:
                self._resume(f"no resume or hold within {limit:g}s")

    def _take_savepoint(self, request: Request) -> None:
        """Commit everything read so far, then pause (or, with stop, exit) and acknowledge:
        the committed checkpoints are the savepoint's state (see savepoint/control.py)."""
        log.info("savepoint %s requested%s", request.id, " (stop)" if request.stop else "")
        ok = self._final_checkpoint(reason="savepoint")
        status = "failed"
        if ok:
            # A request found in progress at start: its pause counts from the CLI's last word.
            since = time.monotonic() if request.heard is None else request.heard
            self._paused = (request.id, since)
            self._paused_at = since
            self.consumer.pause(self.consumer.assignment())
            status = "stopped" if request.stop else "paused"
            self._exit_after_savepoint = request.stop
        elif self._paused is None:  # paused at the assignment while the request waited
            self.consumer.resume(self.consumer.assignment())
        self._event(
            {
                "event": "savepoint",
                "id": request.id,
                "status": status,
                "checkpoint": self.coordinator.next_id - 1 if ok else -1,
            }
        )
        write_ack(
            self.storage,
            self.pipeline.name,
            request.id,
            self.settings.worker_id,
            {
                "status": status,
                "tasks": sorted(self.tasks),
                "error": "" if ok else "the savepoint's checkpoint did not commit",
            },
        )

    def _resume(self, why: str) -> None:
        log.info("resuming after a savepoint: %s", why)
        self._paused = None
        self.consumer.resume(self.consumer.assignment())

    def _close(self) -> None:
        """Bounded: with the broker gone, an abort is left to recovery and close gives up."""
        self.output.abort_timeout = min(self.output.abort_timeout, 3.0)
        try:
            self.output.abort()
        except Exception:
            log.exception("abort on close")
        for task in self.tasks.values():
            task.close()
        self.tasks = {}
        self._source_ends.forget()
        self.liveness.allow(2 * SHUTDOWN_BOUND)  # each of the two waits below is bounded
        self.hung_jobs = self.coordinator.shutdown()
        self.hung_jobs += self.metrics.close()
        if self.hung_jobs:
            log.error(
                "left behind at exit, each still running after %.0f s: %s (a checkpoint "
                "still being written never committed; look for a hung checkpoint storage)",
                SHUTDOWN_BOUND,
                "; ".join(self.hung_jobs),
            )
        self._control.close()
        try:
            self._consumer_call("close", 10.0, self.consumer.close)
        except Exception:
            log.exception("consumer close")
        self.output.close(timeout=2.0 if self._stopping else 10.0)


class RestoredSinceStartError(KafkaClientError):
    """A savepoint restore of the job completed after this worker compiled its plan
    (``Worker._check_not_restored_since_start``): exit EX_TEMPFAIL, and the restart reads the
    job's topics again."""


class ConsumerFencedError(KafkaClientError):
    """The consumer failed fatally, typically "Static consumer fenced by other consumer with
    same group.instance.id" after its session timed out during a broker outage (librdkafka
    #3437); the worker replaces the consumer (``MAX_CONSUMER_REPLACEMENTS``)."""


class _StopNow(Exception):
    """A stop was requested while the broker is unreachable: exit without a final checkpoint."""


def _unknown_topic(exc: Exception) -> bool:
    """``exc`` says the topic does not exist (a describe of a deleted topic)."""
    error = kafka_error(exc)
    return error is not None and error.code() in (
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
    )


def _delete_done(tp: TopicPartition, faults: FaultInjector) -> Any:
    """Callback of a DeleteRecords request's future: a failure is logged (the records are
    deleted next time)."""

    def done(future: Any) -> None:
        exc = future.exception()
        if exc is not None:
            log.info(
                "deleting records of %s[%d] below %d: %s", tp.topic, tp.partition, tp.offset, exc
            )
        faults.point("after_repartition_delete")  # the broker answered

    return done


def _exit_after_stop_bound() -> None:
    log.error(
        "worker did not stop within %.0fs of SIGTERM; exiting without a final checkpoint "
        "(recovery restores the last committed checkpoint)",
        STOP_BOUND,
    )
    exit_now(EX_TEMPFAIL)


#: Cyclic GC thresholds of a worker: a batch of 10,000 records makes ~30,000 short-lived
#: objects (records, decoded values, outputs) without cycles; Python's default (700) ran a
#: young collection every ~25 records (measured: 6 % of a keyed record's instructions).
GC_THRESHOLDS = (50_000, 20, 10)


#: How long (s) the task thread keeps the GIL while a checkpoint thread waits for it
#: (Python's default: 0.005). Materializing a snapshot takes the GIL back after every file
#: operation; at 5 ms a wait, a checkpoint of 16 tasks spent ~0.5 s waiting while the task
#: thread processed records, and records of the next epoch waited in memory that long.
SWITCH_INTERVAL = 0.0005


def tune_interpreter() -> None:
    """Raise the worker's GC thresholds and move everything alive after start-up (modules,
    the pipeline, the clients) out of the collector's sight (``gc.freeze``), so that full
    collections walk only what the job made since; and shorten the GIL switch interval.
    ``SNAPLINE_GC=default`` keeps Python's GC settings."""
    sys.setswitchinterval(SWITCH_INTERVAL)
    if os.environ.get("SNAPLINE_GC", "") == "default":
        return
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def unavailable_sink(exc: BaseException) -> SinkUnavailableError | None:
    """The sink outage that ended a worker, if one did: ``exc`` itself, or what it was
    raised from (the last error of the checkpoints that failed in a row)."""
    found = first_in_chain(exc, lambda e: isinstance(e, SinkUnavailableError))
    return found if isinstance(found, SinkUnavailableError) else None


def run_worker(pipeline: Pipeline, settings: WorkerSettings) -> None:
    """Entry point of a worker process: SIGTERM/SIGINT take a final checkpoint and exit.

    Exit codes: 0 after a stop; EX_TEMPFAIL (75) when a Kafka client cannot go on (broker
    unreachable too long, a hung client call, a fatal client error) - restart the worker, it
    recovers from the committed checkpoint; other errors raise SnaplineError (exit 1)."""
    try:
        worker = Worker(pipeline, settings)
    except KafkaClientError as exc:
        log.error("%s (exit %d: restart the worker)", exc, EX_TEMPFAIL)
        exit_now(EX_TEMPFAIL)
    tune_interpreter()
    signal.signal(signal.SIGTERM, worker.request_stop)
    signal.signal(signal.SIGINT, worker.request_stop)
    # SIGUSR1 writes every thread's Python stack to stderr: how to see where a worker that
    # stopped making progress waits, without stopping it (docs/operations.md).
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    # A fatal signal (an assertion in librdkafka aborts the process: SIGABRT) writes every
    # thread's Python stack to stderr before the process dies of it, as it would have: which
    # client call was running tells a librdkafka defect's trigger apart.
    faulthandler.enable(all_threads=True)
    watchdog = None
    if settings.liveness_timeout:
        worker.liveness.beat()
        watchdog = Watchdog(worker.liveness)
        watchdog.start()
    try:
        worker.run()
    except KafkaClientError as exc:
        log.error("%s (exit %d: restart the worker)", exc, EX_TEMPFAIL)
        exit_now(EX_TEMPFAIL)
    except Exception as exc:
        if unavailable_sink(exc) is not None:
            # A database down: waited out by restarts (the supervisor's backoff, not counted
            # as a crash), each recovering the committed checkpoint and publishing its output.
            log.error(
                "%s (exit %d: restart the worker; it recovers from the committed checkpoint "
                "and publishes its staged output once the sink answers)",
                exc,
                EX_TEMPFAIL,
            )
            exit_now(EX_TEMPFAIL)
        if worker.hung_jobs:
            # A normal exit would join the hung threads, i.e. never end. A configuration error
            # (a superseded worker too) keeps its exit code: a supervisor must not restart it.
            if isinstance(exc, ConfigurationError):
                code = incarnation.exit_code_of(exc)
                with contextlib.suppress(OSError):
                    hand_over_message(redact_text(str(exc)))
                log.error("%s (exit %d)", exc, code)
                exit_now(code)
            log.error("%s (exit 1)", exc)
            exit_now(1)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
    exit_now(0)
