"""Incremental checkpoints: shared files uploaded once, reference-derived retention, manifests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from state_helpers import take_checkpoint

from snapline.pipeline.checkpoint.incremental import (
    MANIFEST_FILE,
    SharedFileRegistry,
    StateManifest,
    discard_unreferenced_files,
    file_checksum,
    local_name,
    parse_shared_file_name,
    shared_directory,
    shared_file_name,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage, crc32_checksum
from snapline.pipeline.errors import CheckpointError, CorruptCheckpointError
from snapline.pipeline.state.backend import StateFile, StateHandle
from snapline.pipeline.state.rocksdb import RocksDBStateBackend

MakeRocks = Callable[..., RocksDBStateBackend]
TASK_DIR = "job/tasks/t0"


def fill(backend: RocksDBStateBackend, keys: range, tag: bytes) -> None:
    for i in keys:
        backend.put(b"key-%06d" % i, tag * 100)


def shared_paths(handle: StateHandle) -> set[str]:
    return {f.path for f in handle.files if "/shared/" in f.path}


def stored_shared(storage: CheckpointStorage) -> set[str]:
    return {f"{TASK_DIR}/shared/{n}" for n in storage.list_dir(f"{TASK_DIR}/shared")}


# ------------------------------------------------------------------ names
def test_shared_names_carry_content_and_uploader() -> None:
    name = shared_file_name("000012.sst", "crc32:0a0b0c0d", 7)
    assert name == "000012-0a0b0c0d-7.sst"
    assert parse_shared_file_name(name) == ("000012.sst", 7)
    assert parse_shared_file_name(name + ".tmp-1234abcd") == ("000012.sst", 7)
    assert parse_shared_file_name("CURRENT") is None
    assert local_name(f"{TASK_DIR}/shared/{name}") == "000012.sst"
    assert local_name(f"{TASK_DIR}/chk-0000000001-a/MANIFEST-000005") == "MANIFEST-000005"
    assert shared_directory(f"{TASK_DIR}/chk-0000000001-a") == f"{TASK_DIR}/shared"
    with pytest.raises(CheckpointError):
        shared_directory("chk-1")


def test_file_checksum_streams(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40_000  # larger than one read chunk
    path = tmp_path / "f"
    path.write_bytes(data)
    assert file_checksum(path) == crc32_checksum(data)


def test_registry_reuses_only_same_location_and_size() -> None:
    registry = SharedFileRegistry()
    sf = StateFile("a/shared/000001-00000000-1.sst", 10, "crc32:00000000")
    registry.record("/root/a/shared", 1, {"000001.sst": sf})
    assert registry.lookup("/root/a/shared", "000001.sst", 10) == sf
    assert registry.lookup("/root/a/shared", "000001.sst", 11) is None
    assert registry.lookup("/elsewhere/shared", "000001.sst", 10) is None
    registry.record("/root/a/shared", 0, {})  # an older checkpoint finishing late never wins
    assert len(registry) == 1
    registry.record("/root/a/shared", 2, {})
    assert len(registry) == 0


# ------------------------------------------------------------------ uploads
def test_second_checkpoint_uploads_only_new_files(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    backend = make_rocksdb()
    fill(backend, range(20_000), b"a")
    first = take_checkpoint(backend, storage, 1)
    full = first.extra["incremental_bytes"]
    assert full == sum(f.size for f in first.files)

    fill(backend, range(0, 20_000, 100), b"b")  # 1% of the keys
    second = take_checkpoint(backend, storage, 2)
    earlier = {f.path for f in first.files}
    uploaded = sum(f.size for f in second.files if f.path not in earlier)
    assert second.extra["incremental_bytes"] == uploaded < full / 4
    reused = shared_paths(first) & shared_paths(second)
    assert reused, "unchanged SST files are referenced, not uploaded again"
    assert all(p.rsplit("-", 1)[-1] == "1.sst" for p in reused)
    new = shared_paths(second) - shared_paths(first)
    assert all(p.endswith("-2.sst") for p in new)

    restored = make_rocksdb()
    restored.restore(second, storage)
    assert restored.get(b"key-000100") == b"b" * 100
    assert restored.get(b"key-000101") == b"a" * 100


def test_manifest_lists_every_file(make_rocksdb: MakeRocks, storage: CheckpointStorage) -> None:
    backend = make_rocksdb()
    fill(backend, range(1000), b"m")
    handle = take_checkpoint(backend, storage, 3)
    manifest_path = handle.extra["manifest"]
    assert manifest_path == f"{TASK_DIR}/chk-0000000003-a1b2c3d4/{MANIFEST_FILE}"
    manifest = StateManifest.decode(storage.read_bytes(manifest_path), manifest_path)
    assert manifest.checkpoint_id == 3
    assert manifest.files == handle.files
    assert {"CURRENT"} <= set(manifest.local_names)
    for f in handle.files:
        assert storage.size(f.path) == f.size
        assert crc32_checksum(storage.read_bytes(f.path)) == f.checksum
    with pytest.raises(CorruptCheckpointError):
        StateManifest.decode(b"{not json", "x")


def test_a_new_backend_instance_uploads_everything_once(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    """After a restore, the restored files are known; files of other instances never are."""
    backend = make_rocksdb()
    fill(backend, range(5000), b"a")
    first = take_checkpoint(backend, storage, 1)

    restored = make_rocksdb()
    restored.restore(first, storage)
    fill(restored, range(10), b"z")
    second = take_checkpoint(restored, storage, 2)
    assert shared_paths(first) <= shared_paths(second)
    earlier = {f.path for f in first.files}
    uploaded = sum(f.size for f in second.files if f.path not in earlier)
    assert second.extra["incremental_bytes"] == uploaded < first.extra["incremental_bytes"] / 2


def test_a_restore_reports_progress_once_per_file(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    """The worker's liveness beat is the backend's ``progress``: a restore of many files (a
    task of gigabytes) beat once at its end, and the watchdog ended every attempt at its
    timeout (the next one started over)."""
    backend = make_rocksdb()
    fill(backend, range(5000), b"a")
    handle = take_checkpoint(backend, storage, 1)
    beats: list[int] = []
    restored = make_rocksdb()
    restored.progress = lambda: beats.append(1)
    restored.restore(handle, storage)
    assert len(beats) == len(handle.files) > 1


# ------------------------------------------------------------------ retention
def _compact(backend: RocksDBStateBackend) -> None:
    backend.db.compact_range(None, None)


def test_retention_deletes_only_unreferenced_files(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    backend = make_rocksdb()
    handles = []
    for checkpoint_id in range(1, 5):
        fill(
            backend,
            range(checkpoint_id * 1000, checkpoint_id * 1000 + 3000),
            bytes([64 + checkpoint_id]),
        )
        if checkpoint_id == 3:
            _compact(backend)  # rewrites everything: older files lose their last reference
        handles.append(take_checkpoint(backend, storage, checkpoint_id))

    retained = handles[-2:]
    before = stored_shared(storage)
    deleted = set(discard_unreferenced_files(storage, TASK_DIR, retained))
    after = stored_shared(storage)
    referenced = set().union(*(shared_paths(h) for h in retained))
    assert deleted, "files only the dropped checkpoints referenced are deleted"
    assert after == before - deleted
    assert referenced <= after
    assert not (deleted & referenced)
    assert deleted == before - referenced

    for checkpoint_id, handle in ((3, retained[0]), (4, retained[1])):
        restored = make_rocksdb()
        restored.restore(handle, storage)
        assert restored.get(b"key-004500") == bytes([64 + checkpoint_id]) * 100
    assert discard_unreferenced_files(storage, TASK_DIR, retained) == []


def test_retention_spares_files_of_newer_in_flight_checkpoints(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    backend = make_rocksdb()
    fill(backend, range(2000), b"a")
    committed = take_checkpoint(backend, storage, 1)
    fill(backend, range(2000, 4000), b"b")
    in_flight = take_checkpoint(backend, storage, 2)  # materialized, not yet committed
    # A crashed upload of an old checkpoint left a temp file behind.
    orphan_tmp = f"{TASK_DIR}/shared/000001-00000000-1.sst.tmp-deadbeef"
    storage.write_bytes(orphan_tmp, b"partial")

    deleted = discard_unreferenced_files(storage, TASK_DIR, [committed])
    assert deleted == [orphan_tmp]
    assert shared_paths(in_flight) <= stored_shared(storage)

    # Once checkpoint 2 commits and 1 is dropped, nothing it references goes.
    discard_unreferenced_files(storage, TASK_DIR, [in_flight])
    assert shared_paths(in_flight) <= stored_shared(storage)
    restored = make_rocksdb()
    restored.restore(in_flight, storage)
    assert restored.get(b"key-003999") == b"b" * 100


def test_retention_of_aborted_checkpoints(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    """Files of a checkpoint that never committed go once a newer checkpoint commits."""
    backend = make_rocksdb()
    fill(backend, range(1000), b"a")
    take_checkpoint(backend, storage, 1)
    fill(backend, range(1000), b"b")
    _compact(backend)
    aborted = take_checkpoint(backend, storage, 2)
    fill(backend, range(1000), b"c")
    _compact(backend)
    committed = take_checkpoint(backend, storage, 3)
    deleted = set(discard_unreferenced_files(storage, TASK_DIR, [committed]))
    assert shared_paths(aborted) - shared_paths(committed) <= deleted
    assert stored_shared(storage) == shared_paths(committed)


def test_retention_with_nothing_retained_deletes_nothing(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    backend = make_rocksdb()
    fill(backend, range(100), b"a")
    take_checkpoint(backend, storage, 1)
    assert discard_unreferenced_files(storage, TASK_DIR, []) == []
    no_id = StateHandle("rocksdb", (), {})
    assert discard_unreferenced_files(storage, TASK_DIR, [no_id]) == []
    assert stored_shared(storage)


def test_concurrent_retention_never_breaks_a_later_checkpoint(
    make_rocksdb: MakeRocks, storage: CheckpointStorage
) -> None:
    """Retention after each commit, interleaved with the next materialization, many times."""
    backend = make_rocksdb(
        write_buffer_bytes=256 << 10,
        target_file_bytes=256 << 10,
        max_bytes_for_level_base=1 << 20,
        level0_compaction_trigger=4,
    )
    committed: list[StateHandle] = []
    for checkpoint_id in range(1, 25):
        fill(
            backend,
            range(checkpoint_id * 97 % 3000, checkpoint_id * 97 % 3000 + 1500),
            bytes([checkpoint_id]),
        )
        snapshot = backend.snapshot(checkpoint_id)
        if committed:
            # Retention runs while this checkpoint materializes; on odd ids the newest
            # materialized checkpoint has not committed yet, so only older ones are retained.
            retained = committed[-3:-1] if checkpoint_id % 2 else committed[-2:]
            discard_unreferenced_files(storage, TASK_DIR, retained)
        handle = snapshot.materialize(storage, f"{TASK_DIR}/chk-{checkpoint_id:010d}-x")
        snapshot.release()
        committed.append(handle)
        missing = [f.path for f in handle.files if not storage.exists(f.path)]
        assert not missing, f"checkpoint {checkpoint_id} references deleted files {missing}"
    restored = make_rocksdb()
    restored.restore(committed[-1], storage)
    assert dict(restored.db.items()) == dict(backend.db.items())
