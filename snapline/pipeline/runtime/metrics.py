"""A worker's operational record: Prometheus metrics on ``--metrics-host``:``--metrics-port``
and the checkpoint history in checkpoint storage (``checkpoint/history.py``), fed where the
worker emits events.

The metric names and labels are listed in docs/operations.md. Labels are the job, the worker
id, the stage (the digit after ``s`` in a task id such as ``s1-p3``; 0 for ``p3``), the task
and, for lag, the topic and partition: never configuration values, so no secret can reach
a label.

Threads: the task thread calls every method; prometheus_client's HTTP server thread reads
the registry (its metric objects are thread-safe); the history writes on its own thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from snapline.connectors.config import redact_text
from snapline.pipeline.checkpoint.history import HistoryEntry, HistoryWriter, TaskTimes
from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.state.backend import StateHandle
from snapline.pipeline.supervisor import RESTARTS_ENV

if TYPE_CHECKING:
    from snapline.pipeline.runtime.coordinator import CompletedCheckpoint, PendingCheckpoint
    from snapline.pipeline.runtime.task import Task

log = logging.getLogger(__name__)

#: Lag, held records and state entries are sampled at most this often (seconds).
SAMPLE_INTERVAL = 1.0
#: Address the endpoint binds by default (``--metrics-host``): every interface, so scrapers on
#: other hosts reach it; ``127.0.0.1`` keeps it on this host.
DEFAULT_METRICS_HOST = "0.0.0.0"
_STAGE = re.compile(r"^s(\d+)-")
# Histogram buckets in seconds: checkpoints range from milliseconds to minutes.
_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def stage_of(task_id: str) -> str:
    """The stage label of a task id: "1" for ``s1-p3``, "0" for ``p3``."""
    match = _STAGE.match(task_id)
    return match.group(1) if match else "0"


class WorkerMetrics:
    """See module docstring. ``port=None``: no HTTP endpoint, the history is still written;
    ``addr``: the address the endpoint binds (``--metrics-host``)."""

    def __init__(
        self,
        job: str,
        worker: str,
        checkpoint_dir: str,
        port: int | None = None,
        addr: str = DEFAULT_METRICS_HOST,
    ) -> None:
        self.job = job
        self.worker = worker
        self._checkpoint_dir = checkpoint_dir
        self.history = HistoryWriter(checkpoint_dir, job, worker)
        self._last_sample = 0.0
        #: Task id -> (id of the Task object, records in, records out, dead letters, late
        #: records dropped) last seen: counters grow by the difference (a restored task starts
        #: counting from 0 again).
        self._seen: dict[str, tuple[int, int, int, int, int]] = {}
        #: Task id -> state file paths of its last checkpoint (incremental bytes = new files).
        self._files: dict[str, set[str]] = {}
        self._lag_labels: set[tuple[str, ...]] = set()
        self._task_labels: set[str] = set()
        self._server: Any = None
        self.port: int | None = None
        self._prom = None
        if port is not None:
            self._prom = _Prometheus(job, worker)
            self._serve(port, addr)

    def _serve(self, port: int, addr: str) -> None:
        from prometheus_client import start_http_server

        assert self._prom is not None
        try:
            self._server, _thread = start_http_server(port, addr=addr, registry=self._prom.registry)
        except OSError as exc:
            self.history.close()
            raise ConfigurationError(
                f"cannot serve metrics on {addr}:{port}: {exc}; choose a free --metrics-port "
                "(with --workers N, PORT to PORT+N-1 must be free) or 0 for any free port, and "
                "a --metrics-host that is an address of this machine"
            ) from exc
        self.port = int(self._server.server_port)
        log.info("metrics of worker %s: http://%s:%d/metrics", self.worker, addr, self.port)

    def close(self) -> list[str]:
        """Stop serving; returns the history writes still running after their bound."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        return self.history.close()

    # ------------------------------------------------------------------ samples
    def maybe_sample(self, tasks: Mapping[str, Task], held: int, consumer: Any) -> None:
        """Records, lag, held output and state entries; at most every SAMPLE_INTERVAL s."""
        now = time.monotonic()
        if self._prom is None or now - self._last_sample < SAMPLE_INTERVAL:
            return
        self._last_sample = now
        self.sample(tasks, held, consumer)

    def count(self, tasks: Mapping[str, Task]) -> None:
        """Add the records each task read, wrote, dead-lettered and dropped as late since the
        last count. Also called just before the worker drops its tasks (a rebalance, a failed
        checkpoint), so that what they counted since the last sample is not lost with them."""
        prom = self._prom
        if prom is None:
            return
        for task_id, task in tasks.items():
            labels = (self.job, self.worker, stage_of(task_id), task_id)
            out = sum(getattr(op, "records_out", 0) for op in task.sink_writers.values())
            now = (id(task), task.records_in, out, task.dead_letters, task.late_dropped)
            before = self._seen.get(task_id)
            if before is None or before[0] != now[0]:
                before = (now[0], 0, 0, 0, 0)
            prom.records_in.labels(*labels).inc(max(0, now[1] - before[1]))
            prom.records_out.labels(*labels).inc(max(0, now[2] - before[2]))
            prom.dead_letters.labels(*labels).inc(max(0, now[3] - before[3]))
            prom.late_dropped.labels(*labels).inc(max(0, now[4] - before[4]))
            self._seen[task_id] = now

    def sample(self, tasks: Mapping[str, Task], held: int, consumer: Any) -> None:
        prom = self._prom
        if prom is None:
            return
        prom.held.labels(self.job, self.worker).set(held)
        prom.tasks.labels(self.job, self.worker).set(len(tasks))
        self.count(tasks)
        for task_id, task in tasks.items():
            labels = (self.job, self.worker, stage_of(task_id), task_id)
            # Reads the backend without changing it (no flush, no settling): every second.
            entries = task.backend.entry_count()
            if entries >= 0:
                prom.state_entries.labels(*labels).set(entries)
        for task_id in self._task_labels - set(tasks):
            labels = (self.job, self.worker, stage_of(task_id), task_id)
            for gauge in (prom.state_entries, prom.last_checkpoint):
                _remove(gauge, labels)
            self._seen.pop(task_id, None)
        self._task_labels = set(tasks)
        self._sample_lag(tasks, consumer)

    def _sample_lag(self, tasks: Mapping[str, Task], consumer: Any) -> None:
        """Lag = the partition's high watermark (the last stable offset: the consumer reads
        read_committed) minus the next offset the worker reads; from librdkafka's cache."""
        from confluent_kafka import TopicPartition

        assert self._prom is not None
        wanted = [(tid, tp) for tid, task in tasks.items() for tp in task.channels]
        try:
            positions = {
                (p.topic, p.partition): p.offset
                for p in consumer.position([TopicPartition(t, p) for _, (t, p) in wanted])
            }
        except Exception as exc:  # a consumer in a rebalance: sample again next time
            log.debug("metrics: consumer positions unavailable: %s", exc)
            return
        seen: set[tuple[str, ...]] = set()
        for task_id, tp in wanted:
            try:
                _low, high = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True)
            except Exception:
                continue
            if high is None or high < 0:
                continue
            position = max(positions.get(tp, -1), tasks[task_id].channels[tp].next_offset)
            if position < 0:
                continue
            labels: tuple[str, ...] = (
                self.job,
                self.worker,
                stage_of(task_id),
                task_id,
                tp[0],
                str(tp[1]),
            )
            self._prom.lag.labels(*labels).set(max(0, high - position))
            seen.add(labels)
        for labels in self._lag_labels - seen:
            _remove(self._prom.lag, labels)
        self._lag_labels = seen

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_completed(self, done: CompletedCheckpoint, commit_seconds: float) -> None:
        """Checkpoint ``done`` passed the commit point ``commit_seconds`` after it was durable."""
        total = time.monotonic() - done.triggered_at
        alignment = done.aligned_at - done.triggered_at
        materialize = done.durable_at - done.aligned_at
        times: dict[str, TaskTimes] = {}
        for task_id, meta in done.tasks.items():
            files = {f.path: f.size for f in meta.state.files} if meta.state else {}
            previous = self._files.get(task_id)
            new = sum(s for p, s in files.items() if previous is None or p not in previous)
            self._files[task_id] = set(files)
            t = meta.timings
            times[task_id] = TaskTimes(
                round(t.get("sync", 0.0), 6),
                round(t.get("alignment", 0.0), 6),
                round(t.get("async", 0.0), 6),
                sum(files.values()),
                new,
            )
        prom = self._prom
        if prom is not None:
            for phase, seconds in (
                ("alignment", alignment),
                ("materialize", materialize),
                ("commit", commit_seconds),
                ("total", total),
            ):
                prom.checkpoint_seconds.labels(self.job, self.worker, phase).observe(seconds)
            prom.checkpoints.labels(self.job, self.worker, "completed").inc()
            prom.last_checkpoint_time.labels(self.job, self.worker).set(time.time())
            for task_id, tt in times.items():
                labels = (self.job, self.worker, stage_of(task_id), task_id)
                prom.task_seconds.labels(*labels, "sync").observe(tt.sync)
                prom.task_seconds.labels(*labels, "alignment").observe(tt.alignment)
                prom.task_seconds.labels(*labels, "async").observe(tt.async_)
                prom.checkpoint_size.labels(*labels, "full").set(tt.bytes)
                prom.checkpoint_size.labels(*labels, "incremental").set(tt.incremental_bytes)
                prom.uploaded_bytes.labels(*labels).inc(tt.incremental_bytes)
                prom.last_checkpoint.labels(*labels).set(done.checkpoint_id)
        self.history.record(
            HistoryEntry(
                kind="checkpoint",
                worker=self.worker,
                status="completed",
                time=done.triggered_wall or time.time() - total,
                checkpoint_id=done.checkpoint_id,
                duration=round(total, 6),
                alignment=round(alignment, 6),
                materialize=round(materialize, 6),
                commit=round(commit_seconds, 6),
                bytes=sum(t.bytes for t in times.values()),
                incremental_bytes=sum(t.incremental_bytes for t in times.values()),
                tasks=times,
            )
        )

    def _checkpoint_ended(self, pending: PendingCheckpoint | None, status: str, why: str) -> None:
        if self._prom is not None:
            self._prom.checkpoints.labels(self.job, self.worker, status).inc()
        if pending is None:
            return
        self.history.record(
            HistoryEntry(
                kind="checkpoint",
                worker=self.worker,
                status=status,
                time=pending.triggered_wall,
                checkpoint_id=pending.checkpoint_id,
                reason=redact_text(why)[:500],
                duration=round(time.monotonic() - pending.triggered_at, 6),
            )
        )

    # ------------------------------------------------------------------ events
    def on_event(self, entry: Mapping[str, Any], pending: PendingCheckpoint | None) -> None:
        """A worker event (the same dicts that go to SNAPLINE_METRICS_FILE); ``pending`` is
        the checkpoint in flight when it happened."""
        kind = entry.get("event")
        prom = self._prom
        if kind == "checkpoint_failed":
            self._checkpoint_ended(pending, "failed", str(entry.get("error", "")))
            if prom is not None and not entry.get("continued"):
                prom.recoveries.labels(self.job, self.worker, "checkpoint_failed").inc()
        elif kind in ("revoked", "lost", "consumer_replaced"):
            if pending is not None:
                why = {
                    "revoked": "partitions revoked (rebalance)",
                    "lost": "partitions lost (the group moved on without this worker)",
                    "consumer_replaced": f"consumer replaced: {entry.get('error', '')}",
                }[str(kind)]
                self._checkpoint_ended(pending, "aborted", why)
            if prom is not None:
                if kind == "consumer_replaced":
                    prom.recoveries.labels(self.job, self.worker, "consumer_replaced").inc()
                else:
                    prom.rebalances.labels(self.job, self.worker, str(kind)).inc()
        elif kind == "assigned" and prom is not None:
            prom.rebalances.labels(self.job, self.worker, "assigned").inc()
        elif kind in ("broker_unavailable", "kafka_lost_commit", "fenced_departed"):
            if prom is not None:
                prom.recoveries.labels(self.job, self.worker, str(kind)).inc()
        elif kind in ("restored", "restored_after_failure"):
            self._restored(entry)
        elif kind == "savepoint":
            if prom is not None:
                prom.savepoints.labels(self.job, self.worker, str(entry.get("status"))).inc()
            self.history.record(
                HistoryEntry(
                    kind="savepoint",
                    worker=self.worker,
                    status=str(entry.get("status", "")),
                    time=time.time(),
                    savepoint=str(entry.get("id", "")),
                    checkpoint_id=int(entry.get("checkpoint", -1)),
                )
            )

    def restored_files(self, task_id: str, state: StateHandle) -> None:
        """A task restored ``state``: its next checkpoint's incremental bytes are the files
        not in it (RocksDB shares unchanged SST files between checkpoints)."""
        self._files[task_id] = {f.path for f in state.files}

    def _restored(self, entry: Mapping[str, Any]) -> None:
        restored: dict[str, int | None] = dict(entry.get("checkpoints", {}))
        seconds = float(entry.get("seconds", 0.0))
        sizes = dict(entry.get("bytes", {}))
        for task_id in list(self._files):
            if task_id not in sizes:  # restored without state, or moved away
                del self._files[task_id]
        prom = self._prom
        if prom is not None:
            prom.restore_seconds.labels(self.job, self.worker).observe(seconds)
            prom.restores.labels(self.job, self.worker).inc()
            for task_id, size in sizes.items():
                labels = (self.job, self.worker, stage_of(task_id), task_id)
                prom.restored_bytes.labels(*labels).inc(int(size))
            # A task restored from checkpoint N: N is its last committed checkpoint until this
            # worker commits the next (without this the gauge is absent on the new owner
            # between a rebalance and its first commit).
            for task_id, checkpoint_id in restored.items():
                if checkpoint_id is not None:
                    labels = (self.job, self.worker, stage_of(task_id), task_id)
                    prom.last_checkpoint.labels(*labels).set(checkpoint_id)
        ids = [c for c in restored.values() if c is not None]
        self.history.record(
            HistoryEntry(
                kind="restore",
                worker=self.worker,
                status="restored",
                time=time.time() - seconds,
                checkpoint_id=max(ids) if ids else -1,
                duration=seconds,
                bytes=sum(int(s) for s in sizes.values()),
                restored=restored,
                reason=str(entry.get("reason", "")),
            )
        )


def _remove(metric: Any, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):
        metric.remove(*labels)


class _Prometheus:
    """The metric objects of one worker, in a registry of their own (no global state)."""

    def __init__(self, job: str, worker: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.process_collector import ProcessCollector

        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        worker_labels = ("job", "worker")
        task_labels = ("job", "worker", "stage", "task")
        self.records_in = Counter(
            "snapline_records_in", "Records read from Kafka by a task.", task_labels, registry=r
        )
        self.records_out = Counter(
            "snapline_records_out",
            "Records a task handed to its sinks (before the commit that publishes them).",
            task_labels,
            registry=r,
        )
        self.dead_letters = Counter(
            "snapline_dead_letters",
            "Records a task sent to the dead-letter topic.",
            task_labels,
            registry=r,
        )
        self.late_dropped = Counter(
            "snapline_late_records_dropped",
            "Late records a task's windows dropped (on_late='drop').",
            task_labels,
            registry=r,
        )
        self.lag = Gauge(
            "snapline_consumer_lag_records",
            "Records between the next offset the worker reads and the partition's last stable "
            "offset.",
            (*task_labels, "topic", "partition"),
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "snapline_checkpoint_duration_seconds",
            "Checkpoint phases of a worker: alignment (trigger until every task passed the "
            "barrier), materialize (until all state is durable), commit (the Kafka commit), "
            "total (trigger to commit).",
            (*worker_labels, "phase"),
            buckets=_BUCKETS,
            registry=r,
        )
        self.task_seconds = Histogram(
            "snapline_task_checkpoint_duration_seconds",
            "A task's part of a checkpoint: sync (the synchronous snapshot at the barrier), "
            "alignment (trigger until the barrier passed), async (writing its state).",
            (*task_labels, "phase"),
            buckets=_BUCKETS,
            registry=r,
        )
        self.checkpoint_size = Gauge(
            "snapline_checkpoint_size_bytes",
            "Size of a task's last checkpoint: full (all files it references) or incremental "
            "(files it uploaded).",
            (*task_labels, "kind"),
            registry=r,
        )
        self.uploaded_bytes = Counter(
            "snapline_checkpoint_uploaded_bytes",
            "Bytes of state files a task uploaded to checkpoint storage.",
            task_labels,
            registry=r,
        )
        self.checkpoints = Counter(
            "snapline_checkpoints",
            "Checkpoints of a worker by outcome: completed, failed, aborted.",
            (*worker_labels, "status"),
            registry=r,
        )
        self.last_checkpoint = Gauge(
            "snapline_last_checkpoint_id",
            "Id of a task's last committed checkpoint.",
            task_labels,
            registry=r,
        )
        self.last_checkpoint_time = Gauge(
            "snapline_last_checkpoint_timestamp_seconds",
            "Unix time of the worker's last committed checkpoint.",
            worker_labels,
            registry=r,
        )
        self.restore_seconds = Histogram(
            "snapline_restore_duration_seconds",
            "Restoring a worker's tasks after an assignment or a failure.",
            worker_labels,
            buckets=_BUCKETS,
            registry=r,
        )
        self.restores = Counter(
            "snapline_restores", "Restores of a worker's tasks.", worker_labels, registry=r
        )
        self.restored_bytes = Counter(
            "snapline_restored_bytes",
            "Bytes of checkpoint state a task restored.",
            task_labels,
            registry=r,
        )
        self.held = Gauge(
            "snapline_held_output_records",
            "Output records held for epochs whose Kafka transaction has not begun.",
            worker_labels,
            registry=r,
        )
        self.state_entries = Gauge(
            "snapline_state_entries",
            "Entries in a task's keyed state (an estimate: see docs/operations.md).",
            task_labels,
            registry=r,
        )
        self.tasks = Gauge("snapline_tasks", "Tasks the worker runs.", worker_labels, registry=r)
        self.recoveries = Counter(
            "snapline_recoveries",
            "Times the worker aborted its epoch and restored its tasks, by reason: "
            "checkpoint_failed, consumer_replaced, broker_unavailable; kafka_lost_commit counts "
            "tasks restored behind a checkpoint Kafka had acknowledged (a broker fault).",
            (*worker_labels, "reason"),
            registry=r,
        )
        self.rebalances = Counter(
            "snapline_rebalances",
            "Consumer-group rebalance callbacks: assigned, revoked, lost.",
            (*worker_labels, "kind"),
            registry=r,
        )
        self.savepoints = Counter(
            "snapline_savepoints",
            "Savepoint requests the worker served, by outcome.",
            (*worker_labels, "status"),
            registry=r,
        )
        restarts = Gauge(
            "snapline_worker_restarts",
            "Times the supervisor restarted this worker (snapline run --workers).",
            worker_labels,
            registry=r,
        )
        restarts.labels(job, worker).set(int(os.environ.get(RESTARTS_ENV, "0") or 0))
