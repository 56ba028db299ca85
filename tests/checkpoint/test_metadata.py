"""Checkpoint metadata encoding, checksums and the offset-commit metadata format."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from snapline.pipeline.checkpoint.metadata import CheckpointRef, TaskCheckpoint, list_checkpoints
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, CorruptCheckpointError
from snapline.pipeline.state.backend import StateFile, StateHandle


def sample(ref: CheckpointRef = CheckpointRef(7, "abc123")) -> TaskCheckpoint:
    return TaskCheckpoint(
        job="orders",
        task_id="p3",
        ref=ref,
        worker_id="w1",
        positions={("orders", 3): 1234, ("refunds", 3): 56},
        state=StateHandle("memory", (StateFile("orders/tasks/p3/x/state.bin", 10, "crc32:00"),)),
        sinks={"parquet": {"files": ["a"]}},
        states=[{"name": "total", "kind": "value"}],
        created_at=1.5,
    )


def test_round_trip() -> None:
    meta = sample()
    assert TaskCheckpoint.decode(meta.encode(), "x") == meta
    keyed = dataclasses.replace(meta, task_id="s1-p3", task_count=4, time={"watermark": 9})
    assert TaskCheckpoint.decode(keyed.encode(), "x") == keyed
    ids = {"orders": "hXaP3c1sQ0qYn5oT2yBv0w", "refunds": "Zm9vYmFyYmF6cXV4cXV1eA"}
    with_ids = dataclasses.replace(meta, topic_ids=ids)
    assert TaskCheckpoint.decode(with_ids.encode(), "x").topic_ids == ids
    assert b"topic_ids" not in meta.encode()  # none recorded: read back as none


def test_flipped_byte_is_detected() -> None:
    data = bytearray(sample().encode())
    index = data.index(b"1234")
    data[index] = ord("9")
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        TaskCheckpoint.decode(bytes(data), "x")


def test_truncated_file_is_detected() -> None:
    with pytest.raises(CorruptCheckpointError):
        TaskCheckpoint.decode(sample().encode()[:-10], "x")


def test_offset_metadata_round_trip_and_foreign_metadata() -> None:
    ref = CheckpointRef(42, "deadbeef")
    assert CheckpointRef.parse_offset_metadata(ref.offset_metadata()) == ref
    assert CheckpointRef.parse_offset_metadata("") is None
    with pytest.raises(CheckpointError, match="different name"):
        CheckpointRef.parse_offset_metadata("some other app")


def test_write_read_and_list(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    for n in (3, 1, 2):
        sample(CheckpointRef(n, "aa")).write(storage)
    refs = list_checkpoints(storage, "orders", "p3")
    assert [r.checkpoint_id for r in refs] == [1, 2, 3]
    assert TaskCheckpoint.read(storage, "orders", "p3", refs[1]).ref == refs[1]
    with pytest.raises(CheckpointError, match="missing"):
        TaskCheckpoint.read(storage, "orders", "p3", CheckpointRef(9, "aa"))


def test_secrets_never_reach_metadata() -> None:
    """Metadata holds positions, handles and sink info, never connection settings."""
    text = sample().encode().decode()
    assert "password" not in text and "sasl" not in text
