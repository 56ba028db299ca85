"""The clock (watermark) each task gets from a savepoint: rescaled or not, and in code that
renumbers stages."""

from __future__ import annotations

from types import SimpleNamespace

from snapline.pipeline.savepoint.format import SavepointMetadata
from snapline.pipeline.savepoint.restore import _clock, _old_stages

MAXP = 128


def _savepoint(
    watermarks: dict[str, int], stage_reads: dict[int, list[str]] | None = None
) -> SavepointMetadata:
    clocks = {
        t: {"watermark": w, "channels": [["x", 0, {"up": {}}]]} for t, w in watermarks.items()
    }
    return SavepointMetadata(
        "job", "x", MAXP, {}, {}, [], [], clocks=clocks, stage_reads=stage_reads or {}
    )


def _watermarks(savepoint: SavepointMetadata, old: int, new: int) -> list[int]:
    out = []
    for p in range(new):
        clock = _clock(savepoint, 1, 1, (old, new), p)
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


def test_an_unchanged_keyed_task_keeps_its_watermark_but_not_its_writers_watermarks() -> None:
    """Its upstream stage may have been rescaled: tasks of the same ids over other key-groups,
    whose old watermarks would run ahead of the new ones' (found by review: the stage's
    watermark jumped to the old writers' 100 while a new writer was at 10)."""
    savepoint = _savepoint({"s1-p0": 5_000, "s1-p1": 10_000})
    expected = {"watermark": 10_000, "channels": []}
    assert _clock(savepoint, 1, 1, (2, 2), 1) == expected
    assert _clock(savepoint, 1, 1, None, 1) == expected


def test_a_source_task_keeps_its_whole_clock() -> None:
    savepoint = _savepoint({"p0": 7_000})
    assert _clock(savepoint, 0, 0, None, 0) == savepoint.clocks["p0"]


def _plan(*stages: tuple[int, tuple[str, ...]]) -> SimpleNamespace:
    """A plan whose stages read the repartition topics of the named key_bys (job "renamed")."""
    topic = "renamed.{}.repartition".format
    return SimpleNamespace(
        stages=[SimpleNamespace(index=i, reads=tuple(topic(n) for n in r)) for i, r in stages],
        repartitions={
            n: SimpleNamespace(name=n, topic=topic(n)) for _, reads in stages for n in reads
        },
    )


def test_a_stage_renumbered_by_the_code_gets_the_clock_of_the_stage_that_read_its_key_bys() -> None:
    """The code adds a re-keying before the window stage: what was s1 (reading by-customer) is
    s2 now, and the new s1 (reading by-region) is new. Clocks went by number: the new stage
    got the window stage's watermark, and the window stage none (event time moved back).
    Stages are matched by the names of the key_bys they read, so a restore into a job of
    another name (other topic names) matches them too."""
    savepoint = _savepoint(
        {"p0": 9_000, "s1-p0": 5_000, "s1-p1": 6_000}, stage_reads={0: [], 1: ["by-customer"]}
    )
    plan = _plan((0, ()), (1, ("by-region",)), (2, ("by-customer",)))
    old = _old_stages(savepoint, plan)
    assert old == {0: 0, 2: 1}
    assert [_clock(savepoint, 2, old.get(2), (2, 2), p) for p in (0, 1)] == [
        {"watermark": 5_000, "channels": []},
        {"watermark": 6_000, "channels": []},
    ]


def test_a_stage_new_in_the_code_starts_at_the_smallest_keyed_watermark() -> None:
    savepoint = _savepoint(
        {"p0": 9_000, "s1-p0": 5_000, "s1-p1": 6_000}, stage_reads={0: [], 1: ["by-customer"]}
    )
    assert _clock(savepoint, 1, None, (2, 2), 0) == {"watermark": 5_000, "channels": []}


def test_a_stage_that_gained_an_input_keeps_the_clock_of_the_stage_it_was() -> None:
    savepoint = _savepoint({"s1-p0": 5_000}, stage_reads={0: [], 1: ["by-customer"]})
    plan = _plan((0, ()), (1, ("by-customer", "by-payer")))
    assert _old_stages(savepoint, plan) == {0: 0, 1: 1}


def test_a_savepoint_of_an_earlier_version_keeps_the_stage_numbers() -> None:
    savepoint = _savepoint({"s1-p0": 5_000})
    plan = SimpleNamespace(
        stages=[SimpleNamespace(index=0, reads=()), SimpleNamespace(index=1, reads=("t",))]
    )
    assert _old_stages(savepoint, plan) == {0: 0, 1: 1}
