"""Checkpoint retention keeps the newest committed checkpoints and deletes only dead ones."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from snapline.pipeline.checkpoint.metadata import (
    COMMITTED_FILE,
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


class _SlowMarks(CheckpointStorage):
    """Checkpoint storage whose write of one checkpoint's commit mark waits for ``release``
    (an S3 PUT in its tail latency, retried)."""

    def __init__(self, root: str, slow: CheckpointRef) -> None:
        super().__init__(root)
        self.slow = f"{slow.directory(JOB, TASK)}/{COMMITTED_FILE}"
        self.release = threading.Event()
        self.writing = threading.Event()

    def write_bytes(self, path: str, data: bytes) -> None:
        if path == self.slow:
            self.writing.set()
            assert self.release.wait(10)
        super().write_bytes(path, data)


def test_a_slow_commit_mark_does_not_let_the_next_retention_delete_its_checkpoint(
    tmp_path: Path,
) -> None:
    """Checkpoint 3 commits and its retention's mark write is slow; checkpoint 4 commits.
    The two retentions ran on the pool's two threads at once: 4's saw 3 unmarked, took it
    for a checkpoint that never committed and deleted it, so 1, 2 and 4 were kept instead
    of 2, 3 and 4. A task's retentions now run in commit order."""
    refs = [CheckpointRef(i, "a1") for i in range(1, 5)]
    storage = _SlowMarks(str(tmp_path), refs[2])
    for ref in refs[:2]:
        _committed(storage, ref)
    for ref in refs[2:]:
        storage.write_bytes(f"{ref.directory(JOB, TASK)}/{METADATA_FILE}", b"{}")
    coordinator = CheckpointCoordinator(
        JOB, "w0", storage, FaultInjector(""), states=[], timeout=10
    )
    coordinator.retain(TASK, refs[2], keep=3)
    assert storage.writing.wait(10)
    coordinator.retain(TASK, refs[3], keep=3)
    time.sleep(0.3)  # time for a second thread to run 4's retention, were it allowed to
    storage.release.set()
    assert coordinator.shutdown() == []
    assert [r.checkpoint_id for r in list_checkpoints(storage, JOB, TASK)] == [2, 3, 4]
    assert storage.exists(f"{refs[2].directory(JOB, TASK)}/{METADATA_FILE}")


class _CutShortDeletes(CheckpointStorage):
    """Checkpoint storage whose removal of one directory stops after its first entry (a crash
    or a storage error in the middle of a tree's removal, or of an object store's prefix)."""

    def __init__(self, root: str, cut: CheckpointRef, first: str) -> None:
        super().__init__(root)
        self.cut = cut.directory(JOB, TASK)
        self.first = first

    def delete_dir(self, path: str) -> None:
        if path != self.cut:
            return super().delete_dir(path)
        names = sorted(self.list_dir(path), key=lambda n: n != self.first)
        self.delete_file(f"{path}/{names[0]}")
        raise OSError("cut short")


def test_a_deletion_cut_short_leaves_no_committed_checkpoint_without_its_files(
    tmp_path: Path,
) -> None:
    """Found by the audit of destructive actions: a directory's removal that stopped after
    the state files (any order a tree's removal takes) left the mark and the metadata. The
    next retention counted that checkpoint as a committed one to keep, in place of a whole
    one, and a rewind would have picked it and failed on it. Now the mark goes first, the
    metadata next: what is left is unmarked, and the next retention deletes it."""
    refs = [CheckpointRef(i, "a1") for i in range(1, 6)]
    storage = _CutShortDeletes(str(tmp_path), refs[0], first="state-0.bin")
    for ref in refs:
        storage.write_bytes(f"{ref.directory(JOB, TASK)}/state-0.bin", b"state")
        _committed(storage, ref)
    coordinator = CheckpointCoordinator(
        JOB, "w0", storage, FaultInjector(""), states=[], timeout=10
    )
    coordinator.retain(TASK, refs[3], keep=3)  # deletes 1 (cut short), keeps 2, 3, 4
    assert coordinator.shutdown() == []
    for ref in list_checkpoints(storage, JOB, TASK):
        directory = ref.directory(JOB, TASK)
        if storage.exists(f"{directory}/{COMMITTED_FILE}"):  # retained, or restorable
            assert storage.exists(f"{directory}/{METADATA_FILE}"), ref
            assert storage.exists(f"{directory}/state-0.bin"), f"{ref} lost its state"
    storage.cut = ""
    coordinator = CheckpointCoordinator(
        JOB, "w0", storage, FaultInjector(""), states=[], timeout=10
    )
    coordinator.retain(TASK, refs[4], keep=3)
    assert coordinator.shutdown() == []
    assert [r.checkpoint_id for r in list_checkpoints(storage, JOB, TASK)] == [3, 4, 5]
