"""``snapline.pipeline.durable``: directories made durably, also where a parent cannot be
opened for its fsync, and from relative paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapline.pipeline import durable


def test_a_parent_that_cannot_be_opened_for_its_fsync_does_not_fail_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint root under a drop-box parent (mode 0711: no read) failed with EACCES, a
    configuration error, on the first start only (the directory was made by then)."""
    opened = os.open
    refused: list[str] = []

    def refuse_the_parent(path: str, flags: int, *args: int) -> int:
        if os.path.normpath(str(path)) == str(tmp_path):
            refused.append(str(path))
            raise PermissionError(13, "Permission denied", str(path))
        return opened(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_the_parent)
    durable.makedirs_durable(tmp_path / "checkpoints" / "job")
    assert (tmp_path / "checkpoints" / "job").is_dir()
    assert refused == [str(tmp_path)], "the parent's fsync was not tried"


def test_a_relative_path_is_made_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    durable.makedirs_durable("a/b")
    assert (tmp_path / "a" / "b").is_dir()


def test_a_file_where_a_directory_goes_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        durable.makedirs_durable(tmp_path / "file")
