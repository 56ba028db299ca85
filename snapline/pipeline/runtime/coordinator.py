"""The worker's checkpoint coordinator: trigger, collect task snapshots, materialize them in
the background, and decide when checkpoint n is durable enough to commit.

Threads: the task thread calls ``trigger``, ``acknowledge``, ``poll`` and ``finish``; the
materialization pool runs ``_materialize`` on the immutable ``TaskSnapshot`` of one task
(snapshot views, pre-commit futures) and touches nothing else.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from snapline.connectors.config import redact_text
from snapline.pipeline.background import SHUTDOWN_BOUND, BackgroundJobs
from snapline.pipeline.checkpoint.metadata import (
    METADATA_FILE,
    CheckpointRef,
    TaskCheckpoint,
    delete_checkpoint,
    is_marked_committed,
    list_checkpoints,
    mark_committed,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, CheckpointStorageError
from snapline.pipeline.runtime.faults import FaultInjector
from snapline.pipeline.runtime.task import TaskSnapshot

log = logging.getLogger(__name__)


@dataclass
class PendingCheckpoint:
    """A triggered checkpoint that has not committed yet."""

    checkpoint_id: int
    expected: set[str]
    triggered_at: float
    snapshots: dict[str, TaskSnapshot] = field(default_factory=dict)
    futures: dict[str, Future[TaskCheckpoint]] = field(default_factory=dict)
    aligned_at: float = 0.0
    #: Wall-clock trigger time (the checkpoint history shows it).
    triggered_wall: float = field(default_factory=time.time)

    @property
    def all_acknowledged(self) -> bool:
        return set(self.futures) >= self.expected


@dataclass(frozen=True)
class CompletedCheckpoint:
    checkpoint_id: int
    tasks: dict[str, TaskCheckpoint]
    triggered_at: float
    aligned_at: float
    durable_at: float
    triggered_wall: float = 0.0


class CheckpointCoordinator:
    """One per worker; at most one checkpoint in flight (later epochs keep processing)."""

    def __init__(
        self,
        job: str,
        worker_id: str,
        storage: CheckpointStorage,
        faults: FaultInjector,
        *,
        states: list[dict[str, Any]],
        timeout: float,
        threads: int = 2,
    ) -> None:
        self.job = job
        self.worker_id = worker_id
        self.storage = storage
        self.faults = faults
        self.timeout = timeout
        self._states = states
        self._jobs = BackgroundJobs(threads, "materialize")
        #: Retentions of each task waiting, in commit order, and the tasks whose retentions
        #: a pool job is running now (``_retain_in_order``).
        self._retentions: dict[str, list[tuple[CheckpointRef, int]]] = {}
        self._retaining: set[str] = set()
        self._retentions_lock = threading.Lock()
        #: A token unique to this worker incarnation: storage paths of two writers never clash.
        self.attempt = uuid.uuid4().hex[:8]
        self.next_id = 1
        self.pending: PendingCheckpoint | None = None

    # ----------------------------------------------------------------- trigger
    def observe_restored(self, checkpoint_id: int | None) -> None:
        """Checkpoint ids continue after every id a restored task has: the one it committed
        and any newer one left in its directory, so ids stay unique per task and leftovers
        of other attempts fall below the next committed id (where retention deletes them)."""
        if checkpoint_id is not None and checkpoint_id >= self.next_id:
            self.next_id = checkpoint_id + 1

    def trigger(self, task_ids: set[str]) -> int:
        if self.pending is not None:
            raise CheckpointError("a checkpoint is already in flight")
        n = self.next_id
        self.next_id += 1
        self.pending = PendingCheckpoint(n, set(task_ids), time.monotonic())
        return n

    def acknowledge(self, snapshot: TaskSnapshot) -> None:
        """A task passed barrier n: materialize its snapshot in the background."""
        pending = self.pending
        if pending is None or snapshot.checkpoint_id != pending.checkpoint_id:
            raise CheckpointError(
                f"task {snapshot.task_id} acknowledged checkpoint {snapshot.checkpoint_id}, "
                f"in flight: {pending.checkpoint_id if pending else None}"
            )
        pending.snapshots[snapshot.task_id] = snapshot
        timings = {
            "sync": snapshot.sync_seconds,
            "alignment": max(0.0, time.monotonic() - pending.triggered_at - snapshot.sync_seconds),
        }
        pending.futures[snapshot.task_id] = self._jobs.submit(
            f"checkpoint {snapshot.checkpoint_id} of task {snapshot.task_id}",
            self._materialize,
            snapshot,
            timings,
            pending.triggered_wall,
        )
        if pending.all_acknowledged:
            pending.aligned_at = time.monotonic()

    def _materialize(
        self, snapshot: TaskSnapshot, timings: dict[str, float], triggered_wall: float
    ) -> TaskCheckpoint:
        started = time.monotonic()
        ref = CheckpointRef(snapshot.checkpoint_id, self.attempt)
        directory = ref.directory(self.job, snapshot.task_id)
        handle = None
        storage_error: Exception | None = None
        if snapshot.state is not None:
            try:
                handle = snapshot.state.materialize(self.storage, directory)
            except Exception as exc:
                storage_error = exc
            finally:
                snapshot.state.release()
        self.faults.point("mid_materialization")
        # The sinks' pre-commits are awaited even when the state failed: only if they all
        # succeeded is the epoch intact (CheckpointStorageError lets it continue).
        sinks: dict[str, dict[str, Any]] = {}
        for name, result in snapshot.sinks.items():
            if isinstance(result, Future):
                result = result.result(timeout=self.timeout)
            if result:
                sinks[name] = result
        if storage_error is not None:
            raise self._storage_error("write the state of", ref, storage_error)
        meta = TaskCheckpoint(
            job=self.job,
            task_id=snapshot.task_id,
            ref=ref,
            worker_id=self.worker_id,
            positions=snapshot.positions,
            state=handle,
            sinks=sinks,
            states=self._states,
            created_at=time.time(),
            timings={**timings, "async": round(time.monotonic() - started, 6)},
            triggered_at=triggered_wall,
            time=snapshot.time,
            task_count=snapshot.task_count,
            topic_ids=snapshot.topic_ids,
        )
        try:
            meta.write(self.storage)
        except Exception as exc:
            raise self._storage_error("write the metadata of", ref, exc) from exc
        return meta

    def _storage_error(self, what: str, ref: CheckpointRef, exc: Exception) -> Exception:
        return CheckpointStorageError(
            f"could not {what} checkpoint {ref.checkpoint_id} to checkpoint storage "
            f"{redact_text(self.storage.uri)}: {redact_text(str(exc))}"
        )

    # ----------------------------------------------------------------- completion
    def poll(self) -> CompletedCheckpoint | None:
        """The in-flight checkpoint once every task's metadata is durable; raises on failure."""
        pending = self.pending
        if pending is None:
            return None
        if time.monotonic() - pending.triggered_at > self.timeout:
            raise CheckpointError(
                f"checkpoint {pending.checkpoint_id} did not complete within {self.timeout}s "
                "(raise checkpoint_timeout, or look for a slow checkpoint storage or sink)"
            )
        if not pending.all_acknowledged or not all(f.done() for f in pending.futures.values()):
            return None
        tasks = {}
        failed: dict[str, BaseException] = {}
        for task_id, future in pending.futures.items():
            error = future.exception()
            if error is None:
                tasks[task_id] = future.result()
            else:
                failed[task_id] = error
        if failed:
            # Only when storage alone failed (every sink pre-committed) is the epoch intact.
            storage_only = all(isinstance(e, CheckpointStorageError) for e in failed.values())
            task_id, error = next(
                (t, e)
                for t, e in failed.items()
                if storage_only or not isinstance(e, CheckpointStorageError)
            )
            kind = CheckpointStorageError if storage_only else CheckpointError
            raise kind(
                f"checkpoint {pending.checkpoint_id} of task {task_id} failed: {error}"
            ) from error
        self.faults.point("after_metadata_write")
        return CompletedCheckpoint(
            pending.checkpoint_id,
            tasks,
            pending.triggered_at,
            pending.aligned_at,
            time.monotonic(),
            pending.triggered_wall,
        )

    def finish(self) -> None:
        self.pending = None

    def cancel(self) -> None:
        """Forget the in-flight checkpoint (its files are never committed; recovery drops them)."""
        self.pending = None

    # ----------------------------------------------------------------- retention
    def retain(self, task_id: str, committed: CheckpointRef, keep: int) -> None:
        """After ``committed`` passed the commit point: mark it committed, then delete the
        task's checkpoints that are provably dead or no longer retained (background).

        A task's retentions run one at a time in commit order, on whichever pool thread: the
        retention of c + 1 takes c, committed but not yet marked (its retention's mark still
        on its way, e.g. a slow storage write), for a checkpoint that never committed and
        deletes it. The pool has two threads, so before, that could happen."""
        with self._retentions_lock:
            self._retentions.setdefault(task_id, []).append((committed, keep))
            if task_id in self._retaining:
                return  # the job running the task's retentions takes this one next
            self._retaining.add(task_id)
        try:
            self._jobs.submit(f"retention of task {task_id}", self._retain_in_order, task_id)
        except BaseException:
            with self._retentions_lock:
                self._retaining.discard(task_id)
            raise

    def _retain_in_order(self, task_id: str) -> None:
        """Run the task's waiting retentions, oldest first, until none is left. One job per
        task at a time, and it takes no pool thread waiting for another."""
        while True:
            with self._retentions_lock:
                waiting = self._retentions[task_id]
                if not waiting:
                    self._retaining.discard(task_id)
                    return
                committed, keep = waiting.pop(0)
            self._retain(task_id, committed, keep)

    def _retain(self, task_id: str, committed: CheckpointRef, keep: int) -> None:
        """Keep ``committed`` and the newest ``keep - 1`` older checkpoints marked committed.

        Deleted: every other checkpoint with an id ≤ ``committed``'s — older committed ones
        past the retention count, and ones that never committed (a checkpoint with a lower
        id, or the same id from another attempt, can never commit once ``committed`` has).
        Never deleted here: checkpoints with higher ids. They may belong to a checkpoint in
        flight, of this worker or of another worker that owns the task by now; they become
        deletable once a checkpoint with an id at least as high commits."""
        try:
            mark_committed(self.storage, self.job, task_id, committed)
            refs = [
                r
                for r in list_checkpoints(self.storage, self.job, task_id)
                if r.checkpoint_id <= committed.checkpoint_id
            ]
            # A mark without metadata is no checkpoint: a zombie's late mark of one that
            # retention had deleted. It is not retained in place of a real one (deleted below).
            older = [
                r
                for r in refs
                if r.checkpoint_id < committed.checkpoint_id
                and is_marked_committed(self.storage, self.job, task_id, r)
                and self.storage.exists(f"{r.directory(self.job, task_id)}/{METADATA_FILE}")
            ]
            retained = set(older[-(keep - 1) :] if keep > 1 else []) | {committed}
            for ref in refs:
                if ref not in retained:
                    delete_checkpoint(self.storage, self.job, task_id, ref)
            self._discard_unreferenced(task_id, sorted(retained))
        except Exception:
            log.exception(
                "retention of task %s failed (retried after the next checkpoint)", task_id
            )

    def _discard_unreferenced(self, task_id: str, retained: list[CheckpointRef]) -> None:
        """Backends with shared files (rocksdb) delete what no retained checkpoint references."""
        try:
            from snapline.pipeline.state import rocksdb
        except ImportError:
            return
        discard = getattr(rocksdb, "discard_unreferenced_files", None)
        if discard is None:
            return
        handles = []
        for ref in retained:
            try:
                meta = TaskCheckpoint.read(self.storage, self.job, task_id, ref)
            except CheckpointError:
                continue
            if meta.state is not None:
                handles.append(meta.state)
        if handles and all(h.backend == "rocksdb" for h in handles):
            discard(self.storage, f"{self.job}/tasks/{task_id}", handles)

    def shutdown(self, bound: float = SHUTDOWN_BOUND) -> list[str]:
        """Let materializations and retention finish, for at most ``bound`` seconds; returns
        the jobs still running then. One that hangs (a storage write on a hung mount) belongs
        to a checkpoint that timed out and never committed; the caller ends the process with
        ``os._exit`` (see ``snapline.pipeline.background``)."""
        return self._jobs.shutdown(bound)
