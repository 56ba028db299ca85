"""The checkpoint history of a job: one small JSON file per checkpoint, restore or savepoint
event, written by each worker into checkpoint storage (``<job>/history/``) for ``snapline ui``.

Checkpoint metadata only survives while retention keeps a checkpoint and never records
failures; the history keeps the last ``KEEP`` events per worker, failed ones with the reason.
Writing is best effort: a history write that fails is logged and never fails a checkpoint.

Threads: ``HistoryWriter.record`` is called on the task thread and only enqueues; one
background thread writes and prunes. ``read_history`` runs wherever a reader wants it.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from snapline.pipeline.background import SHUTDOWN_BOUND, BackgroundJobs
from snapline.pipeline.checkpoint.storage import CheckpointStorage

log = logging.getLogger(__name__)

HISTORY_DIR = "history"
#: Events kept per worker (older ones are deleted every ``PRUNE_EVERY`` writes).
KEEP = 200
PRUNE_EVERY = 50
_NAME = re.compile(r"^(\d{20})-(.+)\.json$")


@dataclass(frozen=True)
class TaskTimes:
    """One task's part of a checkpoint (seconds and bytes)."""

    sync: float = 0.0
    alignment: float = 0.0
    async_: float = 0.0
    bytes: int = 0
    incremental_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "sync": self.sync,
            "alignment": self.alignment,
            "async": self.async_,
            "bytes": self.bytes,
            "incremental_bytes": self.incremental_bytes,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> TaskTimes:
        return TaskTimes(
            float(data.get("sync", 0.0)),
            float(data.get("alignment", 0.0)),
            float(data.get("async", 0.0)),
            int(data.get("bytes", 0)),
            int(data.get("incremental_bytes", 0)),
        )


@dataclass(frozen=True)
class HistoryEntry:
    """One event of the history.

    ``kind`` is "checkpoint", "restore" or "savepoint"; ``status`` "completed", "failed",
    "aborted" (checkpoints), "restored" (restores), "paused"/"stopped"/"failed" (savepoints).
    ``checkpoint_id`` is the checkpoint (for a restore: the newest restored one; -1 none);
    ``tasks`` maps task ids to their times (checkpoints) or restored checkpoint ids (restores,
    as ``TaskTimes`` with only bytes set, see ``restored``).
    """

    kind: str
    worker: str
    status: str
    time: float
    checkpoint_id: int = -1
    reason: str = ""
    #: Seconds from trigger to commit (checkpoints) or of the whole restore.
    duration: float = 0.0
    alignment: float = 0.0
    materialize: float = 0.0
    commit: float = 0.0
    bytes: int = 0
    incremental_bytes: int = 0
    tasks: dict[str, TaskTimes] = field(default_factory=dict)
    #: Restores: the checkpoint each task restored (None: no checkpoint, a fresh start).
    restored: dict[str, int | None] = field(default_factory=dict)
    savepoint: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "worker": self.worker,
            "status": self.status,
            "time": self.time,
            "checkpoint_id": self.checkpoint_id,
            "reason": self.reason,
            "duration": self.duration,
            "alignment": self.alignment,
            "materialize": self.materialize,
            "commit": self.commit,
            "bytes": self.bytes,
            "incremental_bytes": self.incremental_bytes,
            "tasks": {t: v.to_json() for t, v in sorted(self.tasks.items())},
            "restored": dict(sorted(self.restored.items())),
            "savepoint": self.savepoint,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> HistoryEntry:
        return HistoryEntry(
            kind=str(data["kind"]),
            worker=str(data["worker"]),
            status=str(data["status"]),
            time=float(data["time"]),
            checkpoint_id=int(data.get("checkpoint_id", -1)),
            reason=str(data.get("reason", "")),
            duration=float(data.get("duration", 0.0)),
            alignment=float(data.get("alignment", 0.0)),
            materialize=float(data.get("materialize", 0.0)),
            commit=float(data.get("commit", 0.0)),
            bytes=int(data.get("bytes", 0)),
            incremental_bytes=int(data.get("incremental_bytes", 0)),
            tasks={t: TaskTimes.from_json(v) for t, v in data.get("tasks", {}).items()},
            restored={
                t: (None if c is None else int(c)) for t, c in data.get("restored", {}).items()
            },
            savepoint=str(data.get("savepoint", "")),
        )


def history_directory(job: str) -> str:
    return f"{job}/{HISTORY_DIR}"


def _safe(worker: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", worker)


class HistoryWriter:
    """Writes one worker's history entries in the background (see module docstring)."""

    def __init__(self, storage_uri: str, job: str, worker: str) -> None:
        # Its own storage object: test fault hooks count writes per object, and the history
        # must not shift which checkpoint write an injected fault hits.
        self._storage = CheckpointStorage(storage_uri)
        self._job = job
        self._worker = _safe(worker)
        self._jobs = BackgroundJobs(1, "history")
        self._written = 0
        self._last_ns = 0

    def record(self, entry: HistoryEntry) -> None:
        stamp = max(time.time_ns(), self._last_ns + 1)  # names stay unique and ordered
        self._last_ns = stamp
        self._jobs.submit("a checkpoint history entry", self._write, stamp, entry)

    def _write(self, stamp: int, entry: HistoryEntry) -> None:
        directory = history_directory(self._job)
        try:
            self._storage.write_bytes(
                f"{directory}/{stamp:020d}-{self._worker}.json", orjson.dumps(entry.to_json())
            )
            self._written += 1
            if self._written % PRUNE_EVERY == 0:
                # The whole name after the stamp: a suffix match would take worker "1" for
                # "w-1" and prune that worker's entries.
                mine = [
                    n
                    for n in self._storage.list_dir(directory)
                    if (m := _NAME.match(n)) is not None and m.group(2) == self._worker
                ]
                for name in mine[:-KEEP]:
                    self._storage.delete_file(f"{directory}/{name}")
        except Exception as exc:  # best effort: the history never fails a checkpoint
            log.warning("checkpoint history: could not write an entry: %s", exc)

    def close(self, bound: float = SHUTDOWN_BOUND) -> list[str]:
        """Write what is queued, for at most ``bound`` seconds; returns the writes left."""
        return self._jobs.shutdown(bound)


def history_workers(storage: CheckpointStorage, job: str, since: float = 0.0) -> set[str]:
    """The ids of the workers with an entry in ``job``'s history written at ``since`` (a
    time.time() on the writers' clocks) or later: the workers that restored tasks or ended a
    checkpoint since then. A worker's entries stay until it prunes them itself, so without
    ``since`` this is every worker the job has had. By the file names alone, one listing."""
    floor = int(since * 1e9)
    return {
        m.group(2)
        for n in storage.list_dir(history_directory(job))
        if (m := _NAME.match(n)) and int(m.group(1)) >= floor
    }


def read_history(storage: CheckpointStorage, job: str, limit: int = 500) -> list[HistoryEntry]:
    """The newest ``limit`` entries of every worker of ``job``, newest first."""
    directory = history_directory(job)
    names = [n for n in storage.list_dir(directory) if _NAME.match(n)]
    entries = []
    for name in sorted(names, reverse=True)[:limit]:
        try:
            entries.append(
                HistoryEntry.from_json(orjson.loads(storage.read_bytes(f"{directory}/{name}")))
            )
        except Exception as exc:  # a file cut by a crash, or deleted by pruning meanwhile
            log.debug("checkpoint history: skipping %s: %s", name, exc)
    return entries
