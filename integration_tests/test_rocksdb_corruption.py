"""Corrupt RocksDB checkpoints: flipped bytes in a stored SST file of a real checkpoint are
detected on restore, the error names the file, and the recovery rule of DESIGN §3 holds.

Backend + checkpoint storage + checkpoint metadata, no broker: the recovery helper below applies
the runtime's rule (``Worker._load_checkpoint``) to checkpoints written the way the coordinator
writes them. Runtime-level kill tests over both backends live elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from snapline.pipeline.checkpoint.metadata import CheckpointRef, TaskCheckpoint, mark_committed
from snapline.pipeline.checkpoint.restore import restore_committed
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CorruptCheckpointError
from snapline.pipeline.state.rocksdb import RocksDBStateBackend, discard_unreferenced_files

pytestmark = pytest.mark.integration

JOB = "corruption"
TASK = "orders-0"
ATTEMPT = "0badc0de"


@pytest.fixture
def storage(tmp_path: Path) -> CheckpointStorage:
    return CheckpointStorage(str(tmp_path / "checkpoint-storage"))


@pytest.fixture
def backends(tmp_path: Path) -> Iterator[list[RocksDBStateBackend]]:
    made: list[RocksDBStateBackend] = []
    yield made
    for backend in made:
        backend.close()


def open_backend(made: list[RocksDBStateBackend], path: Path) -> RocksDBStateBackend:
    backend = RocksDBStateBackend(path)
    made.append(backend)
    return backend


def checkpoint(
    backend: RocksDBStateBackend, storage: CheckpointStorage, checkpoint_id: int, offset: int
) -> TaskCheckpoint:
    """What the coordinator does: synchronous part, materialize, release, write metadata;
    then, as after the Kafka commit, the committed mark (a rewind restores only those)."""
    ref = CheckpointRef(checkpoint_id, ATTEMPT)
    snapshot = backend.snapshot(checkpoint_id)
    try:
        handle = snapshot.materialize(storage, ref.directory(JOB, TASK))
    finally:
        snapshot.release()
    meta = TaskCheckpoint(
        job=JOB,
        task_id=TASK,
        ref=ref,
        worker_id="w0",
        positions={("orders", 0): offset},
        state=handle,
    )
    meta.write(storage)
    mark_committed(storage, JOB, TASK, ref)
    return meta


def recover(
    backend: RocksDBStateBackend, storage: CheckpointStorage, committed: CheckpointRef, policy: str
) -> TaskCheckpoint:
    """The runtime's rule itself (the worker calls the same function)."""
    return restore_committed(storage, JOB, TASK, committed, backend, on_corrupt=policy)


def flip_bytes(storage: CheckpointStorage, path: str) -> None:
    data = bytearray(storage.read_bytes(path))
    for at in (len(data) // 3, len(data) // 2):
        data[at] ^= 0x5A
    # Bypass write_bytes' atomic rename: corruption happens in place on a real disk.
    with open(storage.full_path(path), "r+b") as fh:
        fh.write(bytes(data))


def write_orders(backend: RocksDBStateBackend, first: int, count: int, version: int) -> None:
    for i in range(first, first + count):
        backend.put(b"customer-%06d" % i, b"%d:" % version + b"x" * 120)


@pytest.fixture
def two_checkpoints(
    tmp_path: Path, storage: CheckpointStorage, backends: list[RocksDBStateBackend]
) -> tuple[TaskCheckpoint, TaskCheckpoint]:
    """c1 with 20k customers; c2 after 1% of them changed (a new SST file on top of c1's)."""
    source = open_backend(backends, tmp_path / "worker-a")
    write_orders(source, 0, 20_000, version=1)
    c1 = checkpoint(source, storage, 1, offset=20_000)
    write_orders(source, 0, 200, version=2)
    c2 = checkpoint(source, storage, 2, offset=20_200)
    source.close()
    return c1, c2


def new_files(c1: TaskCheckpoint, c2: TaskCheckpoint) -> list[str]:
    assert c1.state is not None and c2.state is not None
    old = {f.path for f in c1.state.files}
    return [f.path for f in c2.state.files if f.path.endswith(".sst") and f.path not in old]


def test_flipped_bytes_in_an_sst_fail_recovery_naming_the_file(
    tmp_path: Path,
    storage: CheckpointStorage,
    backends: list[RocksDBStateBackend],
    two_checkpoints: tuple[TaskCheckpoint, TaskCheckpoint],
) -> None:
    c1, c2 = two_checkpoints
    (victim,) = new_files(c1, c2)
    flip_bytes(storage, victim)

    worker_b = open_backend(backends, tmp_path / "worker-b")
    with pytest.raises(CorruptCheckpointError) as failure:
        recover(worker_b, storage, c2.ref, policy="fail")
    message = str(failure.value)
    assert victim in message and "corrupt" in message and "checksum" in message
    # Nothing half-restored: the task has no state and no staging directory left over.
    assert worker_b.get(b"customer-000001") is None
    assert not list(worker_b.task_dir.glob("restore-*"))


def test_rewind_is_an_explicit_opt_in_to_the_earlier_checkpoint(
    tmp_path: Path,
    storage: CheckpointStorage,
    backends: list[RocksDBStateBackend],
    two_checkpoints: tuple[TaskCheckpoint, TaskCheckpoint],
) -> None:
    c1, c2 = two_checkpoints
    (victim,) = new_files(c1, c2)
    flip_bytes(storage, victim)

    worker_b = open_backend(backends, tmp_path / "worker-b")
    meta = recover(worker_b, storage, c2.ref, policy="rewind")
    # State is exactly c1's, and the input must be rewound to c1's barrier positions: the
    # 200 records of (c1, c2] are processed again, and their outputs, which Kafka already
    # committed with c2, are produced a second time (at-least-once for that span).
    assert meta.ref == c1.ref
    assert meta.positions[("orders", 0)] == 20_000 < c2.positions[("orders", 0)]
    assert worker_b.get(b"customer-000000") == b"1:" + b"x" * 120
    assert worker_b.get(b"customer-019999") == b"1:" + b"x" * 120


def test_a_corrupt_shared_file_breaks_every_checkpoint_that_references_it(
    tmp_path: Path,
    storage: CheckpointStorage,
    backends: list[RocksDBStateBackend],
    two_checkpoints: tuple[TaskCheckpoint, TaskCheckpoint],
) -> None:
    c1, c2 = two_checkpoints
    assert c1.state is not None and c2.state is not None
    shared = sorted(
        {f.path for f in c1.state.files if f.path.endswith(".sst")}
        & {f.path for f in c2.state.files}
    )
    assert shared, "c2 references c1's SST files instead of uploading them again"
    flip_bytes(storage, shared[0])

    worker_b = open_backend(backends, tmp_path / "worker-b")
    with pytest.raises(CorruptCheckpointError, match="no earlier readable checkpoint marked"):
        recover(worker_b, storage, c2.ref, policy="rewind")


def test_a_verified_local_copy_makes_remote_corruption_harmless(
    tmp_path: Path,
    storage: CheckpointStorage,
    backends: list[RocksDBStateBackend],
) -> None:
    """Local recovery checks local files against the recorded checksums, not the remote copy."""
    worker_dir = tmp_path / "worker-a"
    source = open_backend(backends, worker_dir)
    write_orders(source, 0, 5_000, version=1)
    c1 = checkpoint(source, storage, 1, offset=5_000)
    source.close()
    assert c1.state is not None
    sst = next(f.path for f in c1.state.files if f.path.endswith(".sst"))
    flip_bytes(storage, sst)

    restarted = open_backend(backends, worker_dir)  # same host, same task directory
    recover(restarted, storage, c1.ref, policy="fail")
    assert restarted.last_restore is not None and restarted.last_restore.reused_files >= 1
    assert restarted.get(b"customer-004999") == b"1:" + b"x" * 120

    elsewhere = open_backend(backends, tmp_path / "worker-b")
    with pytest.raises(CorruptCheckpointError, match=sst.rsplit("/", 1)[-1]):
        recover(elsewhere, storage, c1.ref, policy="fail")


def test_truncated_and_missing_files(
    tmp_path: Path,
    storage: CheckpointStorage,
    backends: list[RocksDBStateBackend],
    two_checkpoints: tuple[TaskCheckpoint, TaskCheckpoint],
) -> None:
    c1, c2 = two_checkpoints
    assert c2.state is not None
    manifest = next(f.path for f in c2.state.files if "/MANIFEST-" in f.path)
    original = storage.read_bytes(manifest)
    with open(storage.full_path(manifest), "r+b") as fh:
        fh.truncate(10)
    worker_b = open_backend(backends, tmp_path / "worker-b")
    with pytest.raises(CorruptCheckpointError, match=manifest):
        recover(worker_b, storage, c2.ref, policy="fail")

    (victim,) = new_files(c1, c2)
    storage.delete_file(victim)
    storage.write_bytes(manifest, original)
    with pytest.raises(CorruptCheckpointError, match="missing"):
        recover(worker_b, storage, c2.ref, policy="fail")


def test_retention_keeps_what_a_rewind_needs(
    tmp_path: Path,
    storage: CheckpointStorage,
    backends: list[RocksDBStateBackend],
    two_checkpoints: tuple[TaskCheckpoint, TaskCheckpoint],
) -> None:
    """With two retained checkpoints, discarding unreferenced files leaves c1 restorable."""
    c1, c2 = two_checkpoints
    assert c1.state is not None and c2.state is not None
    discard_unreferenced_files(storage, f"{JOB}/tasks/{TASK}", [c1.state, c2.state])
    worker_b = open_backend(backends, tmp_path / "worker-b")
    worker_b.restore(c1.state, storage)
    assert worker_b.get(b"customer-000000") == b"1:" + b"x" * 120
