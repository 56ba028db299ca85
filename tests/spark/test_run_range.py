"""`snapline spark run --run-id ID` run again covers the source range its first run recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CorruptCheckpointError
from snapline.pipeline.spark.bounded import _run_range


def test_a_rerun_keeps_the_range_its_first_run_recorded(tmp_path: Path) -> None:
    """A re-run after more input arrived computed --to latest again: its committed tasks
    re-published their output over the old range while its savepoint claimed the new end, so
    the records in between were never output (an audit's repro: 4 of 9 records). The range
    is recorded before the first task and read back."""
    storage = CheckpointStorage(str(tmp_path))
    said: list[str] = []
    first = ({("in", 0): 0, ("in", 1): 0}, {("in", 0): 3, ("in", 1): 2})
    assert _run_range(storage, "job", "r1", *first, said.append) == first
    grown = ({("in", 0): 0, ("in", 1): 0}, {("in", 0): 5, ("in", 1): 4})
    assert _run_range(storage, "job", "r1", *grown, said.append) == first
    assert said == ["run r1 again: over its recorded source range, not the one asked now"]
    assert _run_range(storage, "job", "r2", *grown, said.append) == grown  # another run
    path = tmp_path / "job" / "spark" / "r1" / "_range.json"
    path.write_bytes(path.read_bytes().replace(b'"in",0,3', b'"in",0,9'))
    with pytest.raises(CorruptCheckpointError):
        _run_range(storage, "job", "r1", *grown, said.append)
