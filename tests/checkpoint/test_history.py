"""A worker prunes only its own checkpoint history entries."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from snapline.pipeline.checkpoint import history
from snapline.pipeline.checkpoint.history import HistoryEntry, HistoryWriter, read_history
from snapline.pipeline.checkpoint.storage import CheckpointStorage


def _write(writer: HistoryWriter, worker: str, count: int) -> None:
    for i in range(count):
        writer.record(HistoryEntry("checkpoint", worker, "completed", float(i), i + 1))


def test_pruning_keeps_every_entry_of_a_worker_whose_id_ends_like_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(history, "KEEP", 5)
    monkeypatch.setattr(history, "PRUNE_EVERY", 10)
    other = HistoryWriter(str(tmp_path), "orders", "w-1")
    _write(other, "w-1", 3)
    assert other.close() == []
    pruner = HistoryWriter(str(tmp_path), "orders", "1")
    _write(pruner, "1", 20)  # prunes twice, down to its newest 5
    assert pruner.close() == []
    entries = read_history(CheckpointStorage(str(tmp_path)), "orders")
    assert Counter(e.worker for e in entries) == {"w-1": 3, "1": 5}


def test_history_workers_are_those_with_an_entry_since_a_time(tmp_path: Path) -> None:
    """What a savepoint restore fences: the workers whose newest entry is recent enough that
    a transaction of theirs can still be open (by the stamps in the file names)."""
    storage = CheckpointStorage(str(tmp_path))
    directory = history.history_directory("job")
    for stamp, worker in [(1_000, "old"), (5_000, "w-1"), (9_000, "w1"), (2_000, "w1")]:
        storage.write_bytes(f"{directory}/{stamp * 10**9:020d}-{worker}.json", b"{}")
    storage.write_bytes(f"{directory}/not-an-entry.json", b"{}")
    assert history.history_workers(storage, "job") == {"old", "w-1", "w1"}
    assert history.history_workers(storage, "job", since=5_000) == {"w-1", "w1"}
    assert history.history_workers(storage, "job", since=9_001) == set()
    assert history.history_workers(storage, "other") == set()
