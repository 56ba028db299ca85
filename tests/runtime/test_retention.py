"""Checkpoint retention keeps the newest committed checkpoints and deletes only dead ones."""

from __future__ import annotations

from pathlib import Path

from snapline.pipeline.checkpoint.metadata import (
    METADATA_FILE,
    CheckpointRef,
    list_checkpoints,
    mark_committed,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.runtime.coordinator import CheckpointCoordinator
from snapline.pipeline.runtime.faults import FaultInjector

JOB, TASK = "job", "p0"


def _committed(storage: CheckpointStorage, ref: CheckpointRef) -> None:
    storage.write_bytes(f"{ref.directory(JOB, TASK)}/{METADATA_FILE}", b"{}")
    mark_committed(storage, JOB, TASK, ref)


def test_a_mark_without_its_checkpoint_is_not_retained_in_place_of_a_real_one(
    tmp_path: Path,
) -> None:
    """A zombie that woke after the owner's retention deleted checkpoint 2 marked it
    committed: its directory came back holding only the mark. Retention counted it among the
    retained ones and deleted the real checkpoint 1 instead (a rewind's fallback)."""
    storage = CheckpointStorage(str(tmp_path))
    refs = [CheckpointRef(i, "a1") for i in range(1, 5)]
    for ref in refs:
        _committed(storage, ref)
    storage.delete_dir(refs[1].directory(JOB, TASK))
    mark_committed(storage, JOB, TASK, refs[1])  # the zombie's late mark
    coordinator = CheckpointCoordinator(
        JOB, "w0", storage, FaultInjector(""), states=[], timeout=10
    )
    coordinator.retain(TASK, refs[3], keep=3)
    assert coordinator.shutdown() == []
    assert [r.checkpoint_id for r in list_checkpoints(storage, JOB, TASK)] == [1, 3, 4]
