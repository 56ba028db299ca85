"""The rocksdb backend's own behaviour: options, local files, snapshots, local recovery."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import rocksdict
from state_helpers import take_checkpoint

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import (
    CheckpointError,
    ConfigurationError,
    CorruptCheckpointError,
    StateError,
)
from snapline.pipeline.state import create_backend
from snapline.pipeline.state.backend import StateHandle
from snapline.pipeline.state.memory import MemoryStateBackend
from snapline.pipeline.state.rocksdb import RocksDBResources, RocksDBStateBackend

MakeRocks = Callable[..., RocksDBStateBackend]


def fill(backend: RocksDBStateBackend, keys: int, tag: bytes = b"v", width: int = 100) -> None:
    for i in range(keys):
        backend.put(b"key-%06d" % i, tag * width)


# ------------------------------------------------------------------ options and resources
def test_create_backend_passes_options(tmp_path: Path) -> None:
    backend = create_backend(
        "rocksdb", task_dir=str(tmp_path / "t"), options={"write_buffer_bytes": 1 << 20}
    )
    try:
        assert isinstance(backend, RocksDBStateBackend)
        assert backend.options.write_buffer_bytes == 1 << 20
    finally:
        backend.close()


def test_unknown_option_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="write_buffer_bytes"):
        RocksDBStateBackend(tmp_path / "t", write_bufer_bytes=1)


def test_bad_option_values_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="compression"):
        RocksDBStateBackend(tmp_path / "t", compression="rot13")
    with pytest.raises(ConfigurationError, match="max_write_buffers"):
        RocksDBStateBackend(tmp_path / "t", max_write_buffers=1)


def test_shared_cache_is_shared_between_tasks(make_rocksdb: MakeRocks) -> None:
    resources = RocksDBResources(block_cache_bytes=8 << 20, write_buffer_budget_bytes=32 << 20)
    first = make_rocksdb(shared_cache=resources)
    second = make_rocksdb(shared_cache=resources)
    for backend in (first, second):
        fill(backend, 2000)
        backend.db.flush()
        for i in range(0, 2000, 7):
            assert backend.get(b"key-%06d" % i) == b"v" * 100
    assert first.resources is second.resources
    assert resources.cache.get_usage() > 0
    bare = make_rocksdb(shared_cache=rocksdict.Cache(1 << 20))
    assert bare.resources is not None


def test_shared_cache_of_the_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(StateError, match="RocksDBResources"):
        RocksDBStateBackend(tmp_path / "t", shared_cache={"size": 1})


# ------------------------------------------------------------------ local files
def test_writes_skip_the_wal(make_rocksdb: MakeRocks) -> None:
    backend = make_rocksdb()
    fill(backend, 5000)
    wal_bytes = sum(p.stat().st_size for p in backend.db_dir.glob("*.log"))
    assert wal_bytes == 0


def test_wal_can_be_enabled(make_rocksdb: MakeRocks) -> None:
    backend = make_rocksdb(disable_wal=False)
    fill(backend, 500)
    backend.flush_writes()  # the epoch's buffered writes reach the database (and its WAL)
    assert sum(p.stat().st_size for p in backend.db_dir.glob("*.log")) > 0


def test_a_new_backend_starts_empty_even_with_old_files(tmp_path: Path) -> None:
    task_dir = tmp_path / "task"
    old = RocksDBStateBackend(task_dir)
    fill(old, 100)
    old.close()
    new = RocksDBStateBackend(task_dir)
    try:
        assert new.get(b"key-000001") is None
        assert list((task_dir / "previous").iterdir()), "old files kept for local recovery"
    finally:
        new.close()


def test_old_files_go_after_the_first_checkpoint(
    tmp_path: Path, storage: CheckpointStorage
) -> None:
    task_dir = tmp_path / "task"
    old = RocksDBStateBackend(task_dir)
    fill(old, 100)
    old.close()
    (task_dir / "restore-0000dead").mkdir()  # a restore interrupted by a crash
    new = RocksDBStateBackend(task_dir)
    try:
        assert not (task_dir / "restore-0000dead").exists()
        assert (task_dir / "previous").exists()
        take_checkpoint(new, storage, 1)
        assert not (task_dir / "previous").exists()
    finally:
        new.close()


def test_close_keeps_files_destroy_deletes_them(tmp_path: Path) -> None:
    kept = RocksDBStateBackend(tmp_path / "kept")
    fill(kept, 10)
    kept.close()
    kept.close()  # idempotent
    assert (tmp_path / "kept" / "db").exists()
    gone = RocksDBStateBackend(tmp_path / "gone")
    gone.destroy()
    assert not (tmp_path / "gone").exists()
    with pytest.raises(StateError, match="closed"):
        gone.get(b"x")


def test_map_entries_are_tagged_after_the_prefix(make_rocksdb: MakeRocks) -> None:
    backend = make_rocksdb()
    prefix = b"\x00\x05\x00\x00\x00\x01k\x03"
    backend.put(prefix, b"value")
    backend.map_put(prefix, b"user", b"entry")
    raw = dict(backend.db.items())
    assert raw == {prefix: b"value", prefix + b"\x01user": b"entry"}


def test_entry_count_estimates(make_rocksdb: MakeRocks) -> None:
    backend = make_rocksdb()
    fill(backend, 1000)
    assert 500 <= backend.entry_count() <= 1500


# ------------------------------------------------------------------ snapshots
def test_snapshot_creates_a_hard_link_checkpoint(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    backend = make_rocksdb(local_checkpoints_kept=0)
    fill(backend, 3000)
    snapshot = backend.snapshot(1)
    assert backend.last_snapshot_pause > 0
    names = {p.name for p in snapshot.local_dir.iterdir()}
    assert "CURRENT" in names and any(n.endswith(".sst") for n in names)
    sst = next(snapshot.local_dir.glob("*.sst"))
    assert sst.stat().st_nlink >= 2, "the synchronous part links files, it does not copy them"
    snapshot.materialize(storage, "job/tasks/t0/chk-0000000001-a")
    snapshot.release()
    snapshot.release()
    assert not snapshot.local_dir.exists()


def test_release_without_materialize_deletes_the_links(make_rocksdb: MakeRocks) -> None:
    backend = make_rocksdb()
    fill(backend, 10)
    snapshot = backend.snapshot(1)
    snapshot.release()
    assert not snapshot.local_dir.exists()
    with pytest.raises(CheckpointError, match="released"):
        snapshot.materialize(CheckpointStorage(str(backend.task_dir / "s")), "j/tasks/t/chk-1")


def test_newest_local_checkpoint_is_kept(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    backend = make_rocksdb(local_checkpoints_kept=1)
    kept = []
    for checkpoint_id in (1, 2, 3):
        fill(backend, 50, tag=bytes([checkpoint_id]))
        snapshot = backend.snapshot(checkpoint_id)
        snapshot.materialize(storage, f"job/tasks/t0/chk-{checkpoint_id:010d}-a")
        snapshot.release()
        kept.append(snapshot.local_dir)
    assert [p.exists() for p in kept] == [False, False, True]


def test_restoring_another_backends_checkpoint_fails_clearly(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    memory = MemoryStateBackend()
    memory.put(b"k", b"v")
    handle = take_checkpoint(memory, storage, 1)
    with pytest.raises(CheckpointError, match="'memory' state backend"):
        make_rocksdb().restore(handle, storage)


def test_handle_round_trips_through_json(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    backend = make_rocksdb()
    fill(backend, 100)
    handle = take_checkpoint(backend, storage, 1)
    again = StateHandle.from_json(handle.to_json())
    assert again == handle
    target = make_rocksdb()
    target.restore(again, storage)
    assert target.get(b"key-000042") == b"v" * 100


# ------------------------------------------------------------------ local recovery
def _restart(task_dir: Path, handle: StateHandle, storage: CheckpointStorage) -> Any:
    backend = RocksDBStateBackend(task_dir)
    backend.restore(handle, storage)
    return backend


def test_local_recovery_reuses_verified_local_files(
    tmp_path: Path, storage: CheckpointStorage
) -> None:
    task_dir = tmp_path / "task"
    first = RocksDBStateBackend(task_dir)
    fill(first, 5000)
    handle = take_checkpoint(first, storage, 1)
    fill(first, 10, tag=b"after")  # newer, uncommitted work the restart must not see
    first.close()  # the worker stops; its local files stay

    second = _restart(task_dir, handle, storage)
    try:
        stats = second.last_restore
        assert stats is not None
        sst_bytes = sum(f.size for f in handle.files if f.path.endswith(".sst"))
        assert stats.reused_bytes == sst_bytes > 0
        private = [f for f in handle.files if not f.path.endswith(".sst")]
        assert stats.downloaded_files == len(private)  # only MANIFEST, CURRENT, OPTIONS, ...
        assert second.get(b"key-000001") == b"v" * 100
        assert not (task_dir / "previous").exists()
    finally:
        second.close()


def test_local_recovery_downloads_a_corrupt_local_copy(
    tmp_path: Path, storage: CheckpointStorage
) -> None:
    task_dir = tmp_path / "task"
    first = RocksDBStateBackend(task_dir, local_checkpoints_kept=0)
    fill(first, 5000)
    handle = take_checkpoint(first, storage, 1)
    first.close()
    for sst in (task_dir / "db").glob("*.sst"):
        data = bytearray(sst.read_bytes())
        data[len(data) // 2] ^= 0xFF
        sst.write_bytes(bytes(data))

    second = _restart(task_dir, handle, storage)
    try:
        stats = second.last_restore
        assert stats is not None and stats.reused_files == 0
        assert second.get(b"key-004999") == b"v" * 100
    finally:
        second.close()


def test_restore_failure_keeps_current_state(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    source = make_rocksdb()
    fill(source, 1000)
    handle = take_checkpoint(source, storage, 1)
    target = make_rocksdb()
    target.put(b"mine", b"still here")
    sst = next(f for f in handle.files if f.path.endswith(".sst"))
    storage.delete_file(sst.path)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        target.restore(handle, storage)
    assert target.get(b"mine") == b"still here"
    assert not list(target.task_dir.glob("restore-*"))


@pytest.mark.parametrize("flush", ["write-batch", "ingest"])
def test_buffered_writes_are_read_back_and_reach_snapshots(
    make_rocksdb: MakeRocks,
    tmp_path: Path,
    storage: CheckpointStorage,
    monkeypatch: pytest.MonkeyPatch,
    flush: str,
) -> None:
    """Writes of the open epoch are buffered: reads see them at once (puts, deletes, map
    entries), iteration and snapshots see them too, and a restore replaces them. Either way
    of flushing them (``SST_FLUSH_ENTRIES``)."""
    if flush == "ingest":
        monkeypatch.setattr("snapline.pipeline.state.rocksdb.SST_FLUSH_ENTRIES", 1)
    backend = make_rocksdb()
    backend.put(b"a", b"1")
    backend.put(b"b", b"2")
    backend.delete(b"b")
    prefix = b"\x00\x05\x00\x00\x00\x01k\x03"
    backend.map_put(prefix, b"u1", b"x")
    backend.map_put(prefix, b"u2", b"y")
    backend.map_delete(prefix, b"u2")
    assert backend.get(b"a") == b"1" and backend.get(b"b") is None
    assert backend.map_get(prefix, b"u1") == b"x" and backend.map_get(prefix, b"u2") is None
    assert list(backend.map_items(prefix)) == [(b"u1", b"x")]
    backend.put(b"a", b"3")  # buffered again after the iteration flushed
    snapshot = backend.snapshot(1)
    handle = snapshot.materialize(storage, "tasks/p0/chk-0000000001-x")
    snapshot.release()
    backend.put(b"a", b"uncommitted")
    backend.restore(handle, storage)
    assert backend.get(b"a") == b"3", "the snapshot lacked a buffered write"
    assert backend.get(b"b") is None and backend.map_get(prefix, b"u1") == b"x"


def test_a_full_write_buffer_is_flushed(
    make_rocksdb: MakeRocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("snapline.pipeline.state.rocksdb.WRITE_BUFFER_ENTRIES", 10)
    backend = make_rocksdb()
    fill(backend, 25)
    assert len(backend._pending) < 10
    assert backend.get(b"key-000003") == b"v" * 100


# ------------------------------------------------------------------ read cache
def test_the_read_cache_never_answers_for_a_write_that_bypassed_it(
    make_rocksdb: MakeRocks, tmp_path: Path
) -> None:
    """Reads go through a dict of values known to equal the database's; everything that
    writes to the database outside the per-record path (deletes by predicate, map clears,
    bulk puts, a restore) must leave no stale value in it."""
    storage = CheckpointStorage(str(tmp_path / "storage"))
    backend = make_rocksdb()
    backend.put(b"a", b"1")
    backend.put(b"b", b"2")
    backend.map_put(b"m", b"x", b"3")
    handle = take_checkpoint(backend, storage, 1)  # flushed: the values are cached now
    assert (backend.get(b"a"), backend.get(b"b"), backend.map_get(b"m", b"x")) == (b"1", b"2", b"3")
    assert backend.delete_where(lambda key, value: key == b"a") == 1
    assert backend.get(b"a") is None
    backend.map_clear(b"m")
    assert backend.map_get(b"m", b"x") is None
    backend.put_many([(b"b", b"22")])
    assert backend.get(b"b") == b"22"
    backend.restore(handle, storage)
    assert (backend.get(b"a"), backend.get(b"b"), backend.map_get(b"m", b"x")) == (b"1", b"2", b"3")


def test_the_read_cache_is_bounded(make_rocksdb: MakeRocks, monkeypatch) -> None:
    from snapline.pipeline.state import rocksdb as rocksdb_module

    monkeypatch.setattr(rocksdb_module, "READ_CACHE_ENTRIES", 10)
    backend = make_rocksdb()
    fill(backend, 50, width=1)
    backend.flush_writes()
    assert [backend.get(b"key-%06d" % i) for i in range(50)] == [b"v"] * 50
    assert len(backend._cache) <= 10


def test_a_flush_that_overflows_the_read_cache_caches_what_it_wrote(
    make_rocksdb: MakeRocks, monkeypatch
) -> None:
    from snapline.pipeline.state import rocksdb as rocksdb_module

    monkeypatch.setattr(rocksdb_module, "READ_CACHE_ENTRIES", 10)
    backend = make_rocksdb()
    for i in range(8):
        backend.put(b"old-%d" % i, b"o")
    backend.flush_writes()  # fits: the cache holds the 8
    for i in range(6):
        backend.put(b"new-%d" % i, b"n")
    backend.flush_writes()  # 8 + 6 > 10: the cache starts over with the 6 written
    assert backend._cache == {b"new-%d" % i: b"n" for i in range(6)}
    backend.put(b"new-0", b"changed")  # the written dict became the cache: a new one buffers
    assert backend._cache[b"new-0"] == b"n"
    assert backend.get(b"new-0") == b"changed"
    backend.flush_writes()
    assert backend.get(b"new-0") == b"changed"
    assert [backend.get(b"old-%d" % i) for i in range(8)] == [b"o"] * 8


def test_an_ingested_flush_keeps_its_deletes_and_leaves_no_files(
    make_rocksdb: MakeRocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("snapline.pipeline.state.rocksdb.SST_FLUSH_ENTRIES", 10)
    backend = make_rocksdb()
    for i in range(30):
        backend.put(b"k%03d" % i, b"old")
    backend.flush_writes()  # 30 puts: one SST file
    memtable = "rocksdb.num-entries-active-mem-table"
    assert backend._db.property_int_value(memtable) == 0, "the puts went through the memtable"
    for i in range(0, 30, 2):
        backend.delete(b"k%03d" % i)
    for i in range(1, 30, 2):
        backend.put(b"k%03d" % i, b"new")
    backend.put(b"k100", b"added")
    backend.flush_writes()  # 15 deletes through a write batch, 16 puts in an SST file
    assert backend._db.property_int_value(memtable) <= 15, "the puts went through the memtable"
    backend._cache.clear()  # what follows reads the database
    assert [backend.get(b"k%03d" % i) for i in range(30)] == [
        None if i % 2 == 0 else b"new" for i in range(30)
    ]
    assert backend.get(b"k100") == b"added"
    for i in range(1, 30, 2):
        backend.delete(b"k%03d" % i)
    backend.flush_writes()  # deletes only: no SST file
    backend._cache.clear()
    assert [backend.get(b"k%03d" % i) for i in range(30)] == [None] * 30
    assert backend.get(b"k100") == b"added"
    assert not list(backend.task_dir.glob("flush-*"))
