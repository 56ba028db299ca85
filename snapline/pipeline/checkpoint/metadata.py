"""Checkpoint metadata: what one task's checkpoint holds, and how Kafka offset commits name it.

The metadata file is JSON with a CRC-32 over its canonical body, written atomically after all
of the task's state files are durable. The Kafka offset commit of the same checkpoint (the
commit point) carries ``snapline:1:<checkpoint_id>:<attempt>`` so recovery can find it; after
the commit point an empty ``_committed`` marker is added to the checkpoint's directory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from snapline.pipeline.checkpoint.storage import CheckpointStorage, crc32_checksum
from snapline.pipeline.errors import CheckpointError, CorruptCheckpointError
from snapline.pipeline.state.backend import StateHandle

FORMAT_VERSION = 1
METADATA_FILE = "_metadata.json"
#: Written into a checkpoint's directory once its Kafka transaction committed (the commit point
#: passed): the only evidence, apart from the committed offsets themselves, that it committed.
COMMITTED_FILE = "_committed"
_OFFSET_META = re.compile(r"^snapline:1:(\d+):([0-9a-f]{1,32})$")
_CHK_DIR = re.compile(r"^chk-(\d{10})-([0-9a-f]{1,32})$")


@dataclass(frozen=True, order=True)
class CheckpointRef:
    """Names one checkpoint of one task: the id plus the attempt token of the writer."""

    checkpoint_id: int
    attempt: str

    def offset_metadata(self) -> str:
        return f"snapline:1:{self.checkpoint_id}:{self.attempt}"

    def directory(self, job: str, task_id: str) -> str:
        return f"{task_directory(job, task_id)}/chk-{self.checkpoint_id:010d}-{self.attempt}"

    @staticmethod
    def parse_offset_metadata(text: str | None) -> CheckpointRef | None:
        """The checkpoint named by a committed offset's metadata (None if empty)."""
        if not text:
            return None
        match = _OFFSET_META.match(text)
        if match is None:
            raise CheckpointError(
                f"committed offset metadata {text!r} was not written by Snapline; another "
                "application uses this consumer group: give the pipeline a different name"
            )
        return CheckpointRef(int(match.group(1)), match.group(2))

    @staticmethod
    def parse_directory(name: str) -> CheckpointRef | None:
        match = _CHK_DIR.match(name)
        return None if match is None else CheckpointRef(int(match.group(1)), match.group(2))


#: ``<job>/checkpoint-id-floor.json``: the highest checkpoint id of the job's tasks when
#: ``--reset-state`` deleted their checkpoints. New ids continue above it, as they continue
#: above every stored id: sinks that fence by checkpoint id (PostgreSQL's upsert keeps a row
#: of a higher id) would otherwise refuse the new output of every key the old one wrote.
ID_FLOOR_FILE = "checkpoint-id-floor.json"


def encode_checked(body: Any) -> bytes:
    """``{"body": body, "checksum": crc32 of the body}``: a small JSON file whose corruption
    ``decode_checked`` detects (metadata files use the same layout)."""
    raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    return orjson.dumps({"body": orjson.Fragment(raw), "checksum": crc32_checksum(raw)})


def decode_checked(data: bytes, what: str, legacy_key: str | None = None) -> Any:
    """The body of an ``encode_checked`` file; CorruptCheckpointError if it fails its
    checksum. ``legacy_key``: a file written before checksums (a JSON object with that key
    and no ``body``) is returned whole."""
    try:
        outer = orjson.loads(data)
        if legacy_key is not None and legacy_key in outer and "body" not in outer:
            return outer
        body, checksum = outer["body"], outer["checksum"]
        raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{what} is not valid: {exc!r}") from exc
    if crc32_checksum(raw) != checksum:
        raise CorruptCheckpointError(f"{what} failed its checksum ({checksum})")
    return body


def read_id_floor(storage: CheckpointStorage, job: str) -> int | None:
    """The id the job's checkpoint ids must stay above (None: no reset recorded one)."""
    path = f"{job}/{ID_FLOOR_FILE}"
    if not storage.exists(path):
        return None
    body = decode_checked(storage.read_bytes(path), storage.full_path(path))
    try:
        return int(body["checkpoint_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{storage.full_path(path)} is not valid: {exc!r}") from exc


def raise_id_floor(storage: CheckpointStorage, job: str, checkpoint_id: int) -> None:
    """Keep the job's checkpoint ids above ``checkpoint_id`` from now on."""
    if checkpoint_id > (read_id_floor(storage, job) or 0):
        storage.write_bytes(
            f"{job}/{ID_FLOOR_FILE}", encode_checked({"checkpoint_id": checkpoint_id})
        )


def highest_checkpoint_id(storage: CheckpointStorage, job: str) -> int:
    """The highest checkpoint id the job has used in ``storage``: of any checkpoint directory
    of any of its tasks, or the id floor (0: none). The PostgreSQL sink's rows carry these
    ids and its upsert keeps a row a task wrote at a higher id, so a job's ids must never
    start again below it, in this storage or in another one it moves to (savepoints)."""
    stored = [
        ref.checkpoint_id
        for task_id in storage.list_dir(f"{job}/tasks")
        for ref in list_checkpoints(storage, job, task_id)
    ]
    return max([*stored, read_id_floor(storage, job) or 0])


def task_directory(job: str, task_id: str) -> str:
    return f"{job}/tasks/{task_id}"


@dataclass(frozen=True)
class TaskCheckpoint:
    """The metadata of one task's checkpoint."""

    job: str
    task_id: str
    ref: CheckpointRef
    worker_id: str
    #: Barrier positions: next offset to read, per (topic, partition).
    positions: dict[tuple[str, int], int]
    state: StateHandle | None
    sinks: dict[str, dict[str, Any]] = field(default_factory=dict)
    states: list[dict[str, Any]] = field(default_factory=list)
    created_at: float = 0.0
    #: Seconds per phase of this task's part of the checkpoint: "sync" (the synchronous
    #: snapshot at the barrier), "alignment" (trigger until the barrier passed, sync
    #: excluded), "async" (materializing the state); for the checkpoint history.
    timings: dict[str, float] = field(default_factory=dict)
    #: Wall-clock time the checkpoint was triggered (0.0: not recorded).
    triggered_at: float = 0.0
    #: The task's clock (watermarks), so that recovery never moves event time backwards.
    time: dict[str, Any] | None = None
    #: The tasks of its keyed stage when taken (None: the source stage, or a version before
    #: it was recorded): its state holds the key-group range that count gives it.
    task_count: int | None = None
    #: Id of each topic the task read when taken (Kafka gives a topic a new id each time it
    #: is created; empty: not recorded): its positions are offsets of those topics.
    topic_ids: dict[str, str] = field(default_factory=dict)

    @property
    def checkpoint_id(self) -> int:
        return self.ref.checkpoint_id

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "job": self.job,
            "task": self.task_id,
            "checkpoint_id": self.ref.checkpoint_id,
            "attempt": self.ref.attempt,
            "worker": self.worker_id,
            "positions": [[t, p, o] for (t, p), o in sorted(self.positions.items())],
            "state": None if self.state is None else self.state.to_json(),
            "sinks": self.sinks,
            "states": self.states,
            "created_at": self.created_at,
            "timings": self.timings,
            "triggered_at": self.triggered_at,
            **({"time": self.time} if self.time is not None else {}),
            **({"task_count": self.task_count} if self.task_count is not None else {}),
            **({"topic_ids": self.topic_ids} if self.topic_ids else {}),
        }

    def encode(self) -> bytes:
        return encode_checked(self._body())

    @staticmethod
    def decode(data: bytes, what: str) -> TaskCheckpoint:
        body = decode_checked(data, what)
        if body.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"{what} has format {body.get('format')}; this Snapline reads {FORMAT_VERSION}"
            )
        return TaskCheckpoint(
            job=body["job"],
            task_id=body["task"],
            ref=CheckpointRef(int(body["checkpoint_id"]), body["attempt"]),
            worker_id=body["worker"],
            positions={(t, int(p)): int(o) for t, p, o in body["positions"]},
            state=None if body["state"] is None else StateHandle.from_json(body["state"]),
            sinks=body.get("sinks", {}),
            states=body.get("states", []),
            created_at=float(body.get("created_at", 0.0)),
            timings={k: float(v) for k, v in body.get("timings", {}).items()},
            triggered_at=float(body.get("triggered_at", 0.0)),
            time=body.get("time"),
            task_count=body.get("task_count"),
            topic_ids={str(t): str(i) for t, i in body.get("topic_ids", {}).items()},
        )

    def write(self, storage: CheckpointStorage) -> str:
        path = f"{self.ref.directory(self.job, self.task_id)}/{METADATA_FILE}"
        storage.write_bytes(path, self.encode())
        return path

    @staticmethod
    def read(
        storage: CheckpointStorage, job: str, task_id: str, ref: CheckpointRef
    ) -> TaskCheckpoint:
        path = f"{ref.directory(job, task_id)}/{METADATA_FILE}"
        meta = TaskCheckpoint.decode(storage.read_bytes(path), path)
        if meta.ref != ref or meta.task_id != task_id:
            raise CorruptCheckpointError(
                f"{path} describes {meta.task_id}/{meta.ref}, expected {task_id}/{ref}"
            )
        return meta


def mark_committed(storage: CheckpointStorage, job: str, task_id: str, ref: CheckpointRef) -> None:
    """Record that ``ref`` passed the commit point (idempotent)."""
    storage.write_bytes(f"{ref.directory(job, task_id)}/{COMMITTED_FILE}", b"")


def delete_checkpoint(
    storage: CheckpointStorage, job: str, task_id: str, ref: CheckpointRef
) -> None:
    """Delete checkpoint ``ref`` of a task: its commit mark first, then its metadata, then the
    rest. Deleting a directory is no single step (a tree's removal, an object store's prefix),
    and one cut short (a crash, a storage error) in another order could leave a mark and the
    metadata without the state files: a checkpoint retention keeps in place of a whole one, and
    that a rewind or ``--restore-latest`` would pick, then fail on. In this order a directory
    left behind is unmarked (no committed checkpoint; deleted by the next retention) or whole."""
    directory = ref.directory(job, task_id)
    storage.delete_file(f"{directory}/{COMMITTED_FILE}")
    storage.delete_file(f"{directory}/{METADATA_FILE}")
    storage.delete_dir(directory)


def is_marked_committed(
    storage: CheckpointStorage, job: str, task_id: str, ref: CheckpointRef
) -> bool:
    return storage.exists(f"{ref.directory(job, task_id)}/{COMMITTED_FILE}")


def list_checkpoints(storage: CheckpointStorage, job: str, task_id: str) -> list[CheckpointRef]:
    """The checkpoint directories of a task, oldest first (complete or not)."""
    refs = [
        CheckpointRef.parse_directory(n) for n in storage.list_dir(task_directory(job, task_id))
    ]
    return sorted(r for r in refs if r is not None)
