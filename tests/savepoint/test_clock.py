"""The clock (watermark) each task of a keyed stage gets from a savepoint, rescaled or not."""

from __future__ import annotations

from snapline.pipeline.savepoint.format import SavepointMetadata
from snapline.pipeline.savepoint.restore import _clock

MAXP = 128


def _savepoint(watermarks: dict[str, int]) -> SavepointMetadata:
    clocks = {t: {"watermark": w, "channels": [["x", 0, w]]} for t, w in watermarks.items()}
    return SavepointMetadata("job", "x", MAXP, {}, {}, [], [], clocks=clocks)


def _watermarks(savepoint: SavepointMetadata, old: int, new: int) -> list[int]:
    out = []
    for p in range(new):
        clock = _clock(savepoint, f"s1-p{p}", 1, (old, new), p)
        assert clock is not None
        out.append(clock["watermark"])
    return out


def test_a_task_taking_a_lagging_tasks_key_groups_gets_its_watermark() -> None:
    # Two tasks to four: new s1-p1 takes key-groups 32-63 from old s1-p0, whose records up to
    # its watermark 5000 are replayed to it; old s1-p1's 10000 would make them late.
    savepoint = _savepoint({"s1-p0": 5_000, "s1-p1": 10_000})
    assert _watermarks(savepoint, 2, 4) == [5_000, 5_000, 10_000, 10_000]


def test_merged_tasks_take_the_smallest_watermark_of_their_sources() -> None:
    savepoint = _savepoint({"s1-p0": 1_000, "s1-p1": 2_000, "s1-p2": 3_000, "s1-p3": 4_000})
    assert _watermarks(savepoint, 4, 2) == [1_000, 3_000]


def test_an_unchanged_task_keeps_its_own_clock() -> None:
    savepoint = _savepoint({"s1-p0": 5_000, "s1-p1": 10_000})
    assert _clock(savepoint, "s1-p1", 1, (2, 2), 1) == savepoint.clocks["s1-p1"]
    assert _clock(savepoint, "s1-p1", 1) == savepoint.clocks["s1-p1"]
