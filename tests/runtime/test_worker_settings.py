"""Where a worker keeps its local state, for local and remote checkpoint storage."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapline.pipeline.errors import ConfigurationError
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


def test_an_explicit_local_dir_holds_one_directory_per_worker(tmp_path: Path) -> None:
    """Workers given one --local-dir (``--workers 2 --local-dir D``, or one environment
    for every service on a host) must not share files: each deletes what it does not own."""
    w3 = WorkerSettings("k:9092", "w3", "s3://bucket/c", str(tmp_path / "scratch"))
    w4 = WorkerSettings("k:9092", "w4", "s3://bucket/c", str(tmp_path / "scratch"))
    assert w3.resolved_local_dir() == tmp_path / "scratch" / "w3"
    assert w4.resolved_local_dir() == tmp_path / "scratch" / "w4"


@pytest.mark.parametrize("worker_id", ["", ".", "..", "a/b"])
def test_a_worker_id_that_cannot_name_a_directory_is_refused(
    tmp_path: Path, worker_id: str
) -> None:
    settings = WorkerSettings("k:9092", worker_id, str(tmp_path / "c"), str(tmp_path / "l"))
    with pytest.raises(ConfigurationError, match="cannot name a directory"):
        settings.resolved_local_dir()
