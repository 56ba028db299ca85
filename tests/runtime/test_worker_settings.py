"""Where a worker keeps its local state, for local and remote checkpoint storage."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.runtime import local_lock
from snapline.pipeline.runtime.departed import namesakes, transactional_id
from snapline.pipeline.runtime.worker import WorkerSettings


def test_local_dir_beside_a_local_checkpoint_dir(tmp_path: Path) -> None:
    settings = WorkerSettings("k:9092", "w1", str(tmp_path / "checkpoints"))
    assert settings.resolved_local_dir() == tmp_path / ".snapline-local" / "w1"
    uri = WorkerSettings("k:9092", "w1", f"file://{tmp_path}/checkpoints")
    assert uri.resolved_local_dir() == tmp_path / ".snapline-local" / "w1"


def test_local_dir_for_an_object_store_is_under_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    settings = WorkerSettings("k:9092", "w2", "s3://bucket/checkpoints?endpoint_override=m:9000")
    assert settings.resolved_local_dir() == tmp_path / "cache" / "snapline" / "local" / "w2"


def _mountinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: Path, kind: str) -> None:
    """This process's mount table as the kernel writes it, with ``point`` mounted as ``kind``
    over the real root."""
    table = tmp_path / "mountinfo"
    table.write_text(
        "27 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        f"98 27 0:52 / {point} rw,relatime shared:57 master:3 - {kind} srv:/export rw,vers=4.2\n"
    )
    monkeypatch.setattr(local_lock, "_MOUNTINFO", table)


def test_local_dir_beside_a_checkpoint_dir_on_a_network_filesystem_is_under_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local directory's lock covers one host: beside checkpoints on NFS, a frozen
    worker and its replacement on another host would share it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _mountinfo(tmp_path, monkeypatch, tmp_path / "shared", "nfs4")
    on_nfs = WorkerSettings("k:9092", "w1", str(tmp_path / "shared" / "job" / "checkpoints"))
    assert on_nfs.resolved_local_dir() == tmp_path / "cache" / "snapline" / "local" / "w1"
    # Beside the mount, on the root's ext4: beside the checkpoints, as before.
    local = WorkerSettings("k:9092", "w1", str(tmp_path / "sharedx" / "checkpoints"))
    assert local.resolved_local_dir() == tmp_path / "sharedx" / ".snapline-local" / "w1"


def test_the_mount_type_is_the_innermost_mount_of_the_path(tmp_path: Path) -> None:
    table = (
        "27 1 253:0 / / rw - ext4 /dev/vda rw\n"
        "40 27 0:40 / /mnt/my\\040data rw shared:9 - nfs4 srv:/d rw\n"
        "41 40 0:41 / /mnt/my\\040data/scratch rw - tmpfs tmpfs rw\n"
        "42 27 0:42 / /srv rw - fuse.sshfs me@h:/ rw\n"
        "43 27 0:43 / /srv rw - cifs //h/s rw\n"
    )
    assert local_lock.mount_type(Path("/mnt/my data/jobs/c"), table) == "nfs4"
    assert local_lock.mount_type(Path("/mnt/my data/scratch/x"), table) == "tmpfs"
    assert local_lock.mount_type(Path("/mnt/my datax"), table) == "ext4"
    assert local_lock.mount_type(Path("/srv/a"), table) == "cifs"  # the later mount over /srv
    assert local_lock.mount_type(Path("/"), table) == "ext4"
    # This machine's own table: the test's directory is on a filesystem of this host.
    assert local_lock.mount_type(tmp_path) is not None
    assert local_lock.shared_filesystem(tmp_path) is None


def test_an_explicit_local_dir_holds_one_directory_per_worker(tmp_path: Path) -> None:
    """Workers given one --local-dir (``--workers 2 --local-dir D``, or one environment
    for every service on a host) must not share files: each deletes what it does not own."""
    w3 = WorkerSettings("k:9092", "w3", "s3://bucket/c", str(tmp_path / "scratch"))
    w4 = WorkerSettings("k:9092", "w4", "s3://bucket/c", str(tmp_path / "scratch"))
    assert w3.resolved_local_dir() == tmp_path / "scratch" / "w3"
    assert w4.resolved_local_dir() == tmp_path / "scratch" / "w4"


@pytest.mark.parametrize("worker_id", ["", ".", "..", "a/b", "a b", "host:1", "wörker", "w" * 101])
def test_a_worker_id_kafka_or_a_directory_cannot_take_is_refused(
    tmp_path: Path, worker_id: str
) -> None:
    """It names the local state directory and is part of the static member id, which Kafka
    takes only of letters, digits, '.', '_' and '-'."""
    with pytest.raises(ConfigurationError, match="must be 1-100 characters of letters, digits"):
        WorkerSettings("k:9092", worker_id, str(tmp_path / "c"), str(tmp_path / "l"))


@pytest.mark.parametrize("worker_id", ["w1", "host-a.example.com-0", "A_b.c-d", "w" * 100])
def test_worker_ids_of_the_allowed_characters_are_taken(tmp_path: Path, worker_id: str) -> None:
    settings = WorkerSettings("k:9092", worker_id, str(tmp_path / "c"), str(tmp_path / "l"))
    assert settings.resolved_local_dir() == tmp_path / "l" / worker_id


def test_the_other_jobs_that_would_share_a_workers_transactional_id() -> None:
    """``snapline-<job>-<worker id>`` read at every other '-' that leaves a valid job name
    and worker id."""
    assert namesakes("a", "b-c") == [("a-b", "c")]
    assert namesakes("a-b", "c") == [("a", "b-c")]
    assert namesakes("orders", "w1") == []
    assert namesakes("orders.v2", "host-1-0") == [
        ("orders.v2-host", "1-0"),
        ("orders.v2-host-1", "0"),
    ]
    # a job name may end in "-" and a worker id begin with one
    assert namesakes("a", "-b") == [("a-", "b")]
    assert all(
        transactional_id(j, w) == transactional_id("a", "b-c") for j, w in namesakes("a", "b-c")
    )
