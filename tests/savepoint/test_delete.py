"""``snapline savepoint delete``: a savepoint that a restore in progress needs is kept (found by
the audit of destructive actions: a restore that stopped after changing Kafka is finished
only by a worker started with the same ``--from-savepoint``, so deleting that savepoint left
the job refusing to start until another savepoint was restored), and a deletion removes the
metadata first. Real storage in a temporary directory; the CLI through click's runner."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from snapline.pipeline.checkpoint.metadata import encode_checked
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.cli import main
from snapline.pipeline.savepoint.format import METADATA_FILE, SavepointMetadata
from snapline.pipeline.savepoint.markers import RESTORING


@pytest.fixture(autouse=True)
def _no_checkpoint_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPLINE_CHECKPOINT_DIR", raising=False)


def _savepoint(directory: Path, created_at: float) -> str:
    storage = CheckpointStorage(str(directory))
    meta = SavepointMetadata(
        "job", "0.1.0", 128, {"in": {0: 5}}, {"in": 1}, [], [], created_at=created_at
    )
    storage.write_bytes(METADATA_FILE, meta.encode())
    storage.write_bytes("operators/op/state.parquet", b"rows")
    return str(directory)


def _restoring(job_dir: Path, savepoint: str, created_at: float) -> None:
    CheckpointStorage(str(job_dir)).write_bytes(
        RESTORING,
        encode_checked({"savepoint": savepoint, "created_at": created_at, "token": "t"}),
    )


def test_a_savepoint_a_restore_in_progress_needs_is_kept(tmp_path: Path) -> None:
    job_dir = tmp_path / "checkpoints" / "job"
    needed = _savepoint(job_dir / "savepoints" / "sp-1", 100.0)
    other = _savepoint(job_dir / "savepoints" / "sp-2", 200.0)
    _restoring(job_dir, needed, 100.0)
    runner = CliRunner()

    refused = runner.invoke(main, ["savepoint", "delete", needed])
    assert refused.exit_code == 1, refused.output
    assert "a restore of job job from this savepoint is in progress" in refused.output
    assert "--force" in refused.output
    assert (Path(needed) / METADATA_FILE).exists()

    # Another savepoint of the job goes; so does the needed one with --force.
    assert runner.invoke(main, ["savepoint", "delete", other]).exit_code == 0
    assert not Path(other).exists()
    forced = runner.invoke(main, ["savepoint", "delete", "--force", needed])
    assert forced.exit_code == 0, forced.output
    assert not Path(needed).exists()


def test_a_savepoint_elsewhere_is_kept_when_the_checkpoint_dir_names_its_restore(
    tmp_path: Path,
) -> None:
    job_dir = tmp_path / "checkpoints" / "job"
    needed = _savepoint(tmp_path / "backups" / "before-upgrade", 100.0)
    _restoring(job_dir, needed, 100.0)
    runner = CliRunner()
    # Not beside its job's directory: only --checkpoint-dir finds the marker.
    args = ["savepoint", "delete", needed, "--checkpoint-dir", str(tmp_path / "checkpoints")]
    refused = runner.invoke(main, args)
    assert refused.exit_code == 1 and "in progress" in refused.output, refused.output
    assert (Path(needed) / METADATA_FILE).exists()


def test_an_unreadable_restore_marker_keeps_the_savepoint(tmp_path: Path) -> None:
    job_dir = tmp_path / "checkpoints" / "job"
    needed = _savepoint(job_dir / "savepoints" / "sp-1", 100.0)
    (job_dir / RESTORING).write_bytes(b"garbage")  # it may name this one
    refused = CliRunner().invoke(main, ["savepoint", "delete", needed])
    assert refused.exit_code == 1 and "in progress" in refused.output, refused.output


def test_a_finished_restore_does_not_keep_its_savepoint(tmp_path: Path) -> None:
    job_dir = tmp_path / "checkpoints" / "job"
    done = _savepoint(job_dir / "savepoints" / "sp-1", 100.0)
    # The job was restored from it (its marker of a finished restore), none is in progress.
    CheckpointStorage(str(job_dir)).write_bytes(
        "restored-from-savepoint.json", encode_checked({"savepoint": done, "created_at": 100.0})
    )
    result = CliRunner().invoke(main, ["savepoint", "delete", done])
    assert result.exit_code == 0, result.output
    assert not Path(done).exists()


def test_a_deletion_removes_the_metadata_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deletion cut short (a directory's removal is not atomic) must not leave a savepoint
    that looks complete with files missing: a restore of it would fail part way."""
    path = _savepoint(tmp_path / "sp", 100.0)
    order: list[str] = []
    real_file, real_dir = CheckpointStorage.delete_file, CheckpointStorage.delete_dir

    def delete_file(self: CheckpointStorage, name: str) -> None:
        order.append(f"file {name}")
        real_file(self, name)

    def delete_dir(self: CheckpointStorage, name: str) -> None:
        order.append(f"dir {name!r}")
        assert not (Path(self.root) / METADATA_FILE).exists(), "the metadata outlived its files"
        real_dir(self, name)

    monkeypatch.setattr(CheckpointStorage, "delete_file", delete_file)
    monkeypatch.setattr(CheckpointStorage, "delete_dir", delete_dir)
    assert CliRunner().invoke(main, ["savepoint", "delete", path]).exit_code == 0
    assert order == [f"file {METADATA_FILE}", "dir ''"]
    assert not Path(path).exists()


def test_a_directory_without_metadata_is_not_deleted(tmp_path: Path) -> None:
    leftover = tmp_path / "sp"
    (leftover / "operators").mkdir(parents=True)
    result = CliRunner().invoke(main, ["savepoint", "delete", str(leftover)])
    assert result.exit_code == 1
    assert "not a savepoint" in result.output and "by hand" in result.output
    assert leftover.exists()
