"""Restoring a task's state from the checkpoint its committed offsets name, and the rule for a
corrupt one (``on_corrupt_checkpoint``): fail by default, rewind only when asked.

Threads: the task thread, while a task is (re)built.
"""

from __future__ import annotations

import logging

from snapline.pipeline.checkpoint.metadata import (
    CheckpointRef,
    TaskCheckpoint,
    is_marked_committed,
    list_checkpoints,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, CorruptCheckpointError
from snapline.pipeline.state.backend import KeyedStateBackend

log = logging.getLogger(__name__)


def restore_committed(
    storage: CheckpointStorage,
    job: str,
    task_id: str,
    committed: CheckpointRef,
    backend: KeyedStateBackend,
    *,
    on_corrupt: str = "fail",
) -> TaskCheckpoint:
    """Restore ``backend`` from checkpoint ``committed``; returns the metadata actually used.

    The Kafka offsets of ``committed`` are committed, so only its state is consistent with the
    output already written. If it is corrupt: ``on_corrupt="fail"`` raises an error saying so;
    ``"rewind"`` restores the newest readable earlier checkpoint marked committed instead,
    whose positions the caller must seek to (the records in between are processed again:
    at-least-once there). Only a committed one: the sinks then recover with its metadata,
    which names output that was published; a checkpoint that never committed names staged
    output that was aborted (published by the rewind, it would be output twice) or swept
    (the rewind would fail at every restart for want of it).
    """
    try:
        return _restore(storage, job, task_id, committed, backend)
    except CorruptCheckpointError as exc:
        if on_corrupt != "rewind":
            raise CorruptCheckpointError(
                f"task {task_id}: committed checkpoint {committed.checkpoint_id} is unusable "
                f"({exc}). Its Kafka offsets are committed, so no earlier checkpoint is "
                "consistent with the output already written. Restore the file from a "
                "backup, or set on_corrupt_checkpoint='rewind' to restart from an earlier "
                "checkpoint and accept duplicate output for the records in between."
            ) from exc
        cause = exc
    for ref in reversed(list_checkpoints(storage, job, task_id)):
        if ref.checkpoint_id >= committed.checkpoint_id or not is_marked_committed(
            storage, job, task_id, ref
        ):
            continue
        try:
            meta = _restore(storage, job, task_id, ref, backend)
        except CheckpointError:
            continue
        log.error(
            "task %s: checkpoint %d is corrupt (%s); REWINDING to checkpoint %d: "
            "output between them will be written again (at-least-once for that span)",
            task_id,
            committed.checkpoint_id,
            cause,
            ref.checkpoint_id,
        )
        return meta
    raise CorruptCheckpointError(
        f"task {task_id}: checkpoint {committed.checkpoint_id} is corrupt ({cause}) and no "
        "earlier readable checkpoint marked committed is retained"
    ) from cause


def _restore(
    storage: CheckpointStorage,
    job: str,
    task_id: str,
    ref: CheckpointRef,
    backend: KeyedStateBackend,
) -> TaskCheckpoint:
    meta = TaskCheckpoint.read(storage, job, task_id, ref)
    if meta.state is not None:
        backend.restore(meta.state, storage)
    return meta
