"""The rewind of ``on_corrupt_checkpoint='rewind'`` picks only checkpoints that committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapline.pipeline.checkpoint.metadata import (
    METADATA_FILE,
    CheckpointRef,
    TaskCheckpoint,
    mark_committed,
)
from snapline.pipeline.checkpoint.restore import restore_committed
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CorruptCheckpointError
from snapline.pipeline.state import create_backend


def _checkpoint(storage: CheckpointStorage, cid: int, committed: bool) -> CheckpointRef:
    ref = CheckpointRef(cid, "a1b2c3d4")
    TaskCheckpoint("job", "p0", ref, "w0", {("orders", 0): cid * 100}, None).write(storage)
    if committed:
        mark_committed(storage, "job", "p0", ref)
    return ref


def _corrupt(storage: CheckpointStorage, ref: CheckpointRef) -> None:
    path = f"{ref.directory('job', 'p0')}/{METADATA_FILE}"
    data = bytearray(storage.read_bytes(path))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(path, bytes(data))


def _rewind(storage: CheckpointStorage, committed: CheckpointRef) -> TaskCheckpoint:
    backend = create_backend("memory", task_dir="", options={})
    return restore_committed(storage, "job", "p0", committed, backend, on_corrupt="rewind")


def test_a_rewind_skips_an_earlier_checkpoint_that_never_committed(tmp_path: Path) -> None:
    # 9's Kafka commit failed (its epoch was aborted; its staged sink output is dead), then 10
    # committed and is found corrupt: the rewind goes to 8, not to 9, whose sink metadata names
    # aborted output.
    storage = CheckpointStorage(str(tmp_path))
    _checkpoint(storage, 8, committed=True)
    _checkpoint(storage, 9, committed=False)
    newest = _checkpoint(storage, 10, committed=True)
    _corrupt(storage, newest)
    meta = _rewind(storage, newest)
    assert meta.ref.checkpoint_id == 8
    assert meta.positions == {("orders", 0): 800}


def test_without_an_earlier_committed_checkpoint_the_rewind_fails(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    _checkpoint(storage, 9, committed=False)
    newest = _checkpoint(storage, 10, committed=True)
    _corrupt(storage, newest)
    with pytest.raises(CorruptCheckpointError, match="no earlier readable checkpoint marked"):
        _rewind(storage, newest)


def _memory_checkpoint(storage: CheckpointStorage, cid: int, value: bytes) -> CheckpointRef:
    ref = CheckpointRef(cid, "a1b2c3d4")
    backend = create_backend("memory", task_dir="", options={})
    backend.put(b"count", value)
    state = backend.snapshot(cid).materialize(storage, ref.directory("job", "p0"))
    TaskCheckpoint("job", "p0", ref, "w0", {("orders", 0): cid * 100}, state).write(storage)
    mark_committed(storage, "job", "p0", ref)
    return ref


def test_a_missing_memory_state_file_rewinds_to_the_earlier_committed_checkpoint(
    tmp_path: Path,
) -> None:
    """A memory state file gone from storage is a corrupt checkpoint, as a missing RocksDB
    file is: the rewind restores 8 (it failed with a plain "is missing" CheckpointError)."""
    storage = CheckpointStorage(str(tmp_path))
    _memory_checkpoint(storage, 8, b"eight")
    newest = _memory_checkpoint(storage, 10, b"ten")
    state = TaskCheckpoint.read(storage, "job", "p0", newest).state
    assert state is not None
    (state_file,) = state.files
    storage.delete_file(state_file.path)
    backend = create_backend("memory", task_dir="", options={})
    with pytest.raises(CorruptCheckpointError, match=r"state-memory\.bin is missing"):
        restore_committed(storage, "job", "p0", newest, backend)  # on_corrupt="fail"
    meta = restore_committed(storage, "job", "p0", newest, backend, on_corrupt="rewind")
    assert meta.ref.checkpoint_id == 8
    assert meta.positions == {("orders", 0): 800}
    assert backend.get(b"count") == b"eight"
