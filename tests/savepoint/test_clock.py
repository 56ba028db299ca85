"""The clock (watermark) each task gets from a savepoint: rescaled or not, and in code that
renumbers stages."""

from __future__ import annotations

from types import SimpleNamespace

import orjson
import pytest

from snapline import (
    Context,
    KafkaSource,
    KeyedProcessFunction,
    Pipeline,
    session,
    sliding,
    tumbling,
)
from snapline.pipeline.keygroups import key_group, operator_index_for_key_group
from snapline.pipeline.record import ListedMessage
from snapline.pipeline.runtime.faults import FaultInjector
from snapline.pipeline.runtime.task import Task
from snapline.pipeline.runtime.watermarks import WatermarkRecord, decode_floors
from snapline.pipeline.savepoint.format import InFlight, SavepointMetadata
from snapline.pipeline.savepoint.restore import _clock, _old_stages, _task_counts
from snapline.pipeline.state import create_backend
from snapline.testing import _CapturingSink

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


def test_a_savepoint_restored_under_another_job_name_matches_task_counts_by_key_by_name() -> None:
    """Repartition topics are named after their job: matched by topic, a savepoint restored
    as job "job2" found no task count, and each new task took the watermark of the old task
    of its number ([5000, 10000, 5000, 5000]): records replayed to new s1-p1 were late."""
    savepoint = _savepoint({"s1-p0": 5_000, "s1-p1": 10_000})
    savepoint = SavepointMetadata(
        "job",
        "x",
        MAXP,
        {},
        {},
        [],
        [InFlight("by-customer", "job.by-customer.repartition", 2, [])],
        clocks=savepoint.clocks,
    )
    rep = SimpleNamespace(name="by-customer", topic="job2.by-customer.repartition", downstream=1)
    plan = SimpleNamespace(repartitions={7: rep})
    counts = _task_counts(savepoint, plan, {"job2.by-customer.repartition": 4})
    assert counts == {1: (2, 4)}
    assert [_clock(savepoint, 1, 1, counts[1], p)["watermark"] for p in range(4)] == [  # type: ignore[index]
        5_000,
        5_000,
        10_000,
        10_000,
    ]


def test_merged_tasks_take_the_smallest_watermark_of_their_sources() -> None:
    savepoint = _savepoint({"s1-p0": 1_000, "s1-p1": 2_000, "s1-p2": 3_000, "s1-p3": 4_000})
    assert _watermarks(savepoint, 4, 2) == [1_000, 3_000]


def test_merged_tasks_keep_the_faster_tasks_watermark_as_key_group_floors() -> None:
    """Found by review: the merged task's key-groups from old s1-p1 went back from 2000 to
    1000, so their windows that had fired (kept for the allowed lateness) took updates
    without emitting them, and purged ones opened and fired a second time."""
    savepoint = _savepoint({"s1-p0": 1_000, "s1-p1": 2_000, "s1-p2": 3_000, "s1-p3": 4_000})
    first = _clock(savepoint, 1, 1, (4, 2), 0)
    assert first is not None
    # New p0 holds key-groups 0-63: 0-31 were old p0's, 32-63 old p1's.
    assert first["watermark"] == 1_000
    assert decode_floors(first["floors"]) == {g: 2_000 for g in range(32, 64)}
    # Taken again before the watermark passed them, and split into two: a key-group's time is
    # its floor where it has one.
    again = SavepointMetadata("job", "x", MAXP, {}, {}, [], [], clocks={"s1-p0": first})
    split = [_clock(again, 1, 1, (1, 2), p) for p in (0, 1)]
    assert split[0] == first
    assert split[1] == {"watermark": 1_000, "channels": []}


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


class _Out:
    """The task's Kafka output (dead letters); nothing here is produced to Kafka."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes]] = []

    def produce(self, epoch, topic, value, key, headers=None, partition=-1, timestamp=0):  # noqa: ANN001, ANN201
        self.records.append((topic, value))

    def direct_producer(self, epoch):  # noqa: ANN001, ANN201
        return None


class _Watermarks(KeyedProcessFunction):
    def process(self, value: dict, ctx: Context) -> list[int]:
        return [ctx.watermark]


def _window_after_merge(lateness: int | None) -> tuple[list[dict], list[dict], int]:
    """A one-key tumbling count whose window [100, 150) fired at watermark 200 in the old task
    that held the key; the stage is then merged from two tasks into one, the other old task
    being at 50, and a record at 130 arrives. Returns (emitted before, emitted after, dead
    letters after). ``lateness`` None: a process function that emits ``ctx.watermark``
    instead of the window."""
    committed: list = []
    p = Pipeline("rescaled-window")
    keyed = p.source(KafkaSource("in", timestamp=lambda v: v["t"])).key_by(
        lambda v: v["k"], name="a", partitions=1
    )
    if lateness is None:
        keyed.process(_Watermarks()).sink(_CapturingSink("cap", committed))
    else:
        keyed.window(tumbling(50), allowed_lateness=lateness).count().sink(
            _CapturingSink("cap", committed)
        )
    plan = p.stages()
    (rep,) = plan.repartitions.values()
    topic, stage = rep.topic, rep.downstream
    backend = create_backend("memory", task_dir="", options={})
    out = _Out()

    def task(time_state: dict | None) -> Task:
        return Task(
            f"s{stage}-p0", p, {(topic, 0): 0}, backend, out, worker_id="w", epoch=1,
            on_snapshot=lambda s: None, faults=FaultInjector(""), stage=stage, plan=plan,
            topic_partitions={"in": 1, topic: 1}, time_state=time_state,
        )  # fmt: skip

    def record(t: int, offset: int) -> ListedMessage:
        return ListedMessage(topic, 0, offset, orjson.dumps({"k": "k", "t": t}), b"sk", t)

    def emitted(t: Task) -> list[dict]:
        sink = t.sink_writers["cap"].writer
        return [v for values in sink._epochs.values() for v in values]  # type: ignore[attr-defined]

    old = task(None)
    old.enqueue((topic, 0), [record(120, 0)])
    old.run()
    old.on_watermark_record((topic, 0), WatermarkRecord("p0", 200, False))
    old.run()
    before = emitted(old)
    owner = operator_index_for_key_group(key_group(b"k", p.max_parallelism), 2, p.max_parallelism)
    marks = {f"s{stage}-p{owner}": 200, f"s{stage}-p{1 - owner}": 50}
    clocks = {t: {"watermark": w, "channels": []} for t, w in marks.items()}
    savepoint = SavepointMetadata("j", "x", p.max_parallelism, {}, {}, [], [], clocks=clocks)
    dead = len(out.records)
    new = task(_clock(savepoint, stage, stage, (2, 1), 0))
    assert new.watermark == 50
    new.enqueue((topic, 0), [record(130, 1)])
    new.run()
    new.on_watermark_record((topic, 0), WatermarkRecord("p0", 400, False))
    new.run()
    return before, emitted(new), len(out.records) - dead


def test_a_window_that_fired_before_a_merge_emits_its_late_update_once() -> None:
    """Found by review: the record within the allowed lateness updated the fired window, but
    it was never emitted (its end - 1 was above the merged task's watermark, and its fire
    timer was gone)."""
    before, after, dead = _window_after_merge(lateness=100)
    assert before == [{"key": "k", "start": 100, "end": 150, "value": 1}]
    assert after == [{"key": "k", "start": 100, "end": 150, "value": 2}] and dead == 0


def test_a_window_purged_before_a_merge_does_not_fire_again() -> None:
    """Found by review: the purged window opened again and fired a second time; the record is
    late where its key's event time is, a dead letter."""
    before, after, dead = _window_after_merge(lateness=0)
    assert before == [{"key": "k", "start": 100, "end": 150, "value": 1}]
    assert after == [] and dead == 1


def test_a_process_function_sees_its_keys_event_time_after_a_merge() -> None:
    before, after, _ = _window_after_merge(lateness=None)
    assert before == [-(1 << 63)]  # the old task's first record came before any watermark
    assert after == [200]  # the task is at 50; the key's key-group was at 200


@pytest.mark.parametrize("assigner", ["tumbling", "session", "sliding"])
def test_windows_kept_for_an_allowed_lateness_the_new_code_raised_are_purged(
    assigner: str,
) -> None:
    """Found by review: a window's purge timer is registered when the window is created,
    with the allowed lateness of the code then. Code restored with a larger lateness fired
    the window and kept it for late records, but nothing ever purged it: every window open
    at the upgrade stayed in state (and in every checkpoint) for good."""
    windows = {"tumbling": tumbling(100), "session": session(100), "sliding": sliding(100)}

    def pipeline(lateness: int) -> Pipeline:
        p = Pipeline("raised-lateness")
        p.source(KafkaSource("in", timestamp=lambda v: v["t"])).key_by(
            lambda v: v["k"], name="a", partitions=1
        ).window(windows[assigner], allowed_lateness=lateness).count().sink(
            _CapturingSink("cap", [])
        )
        return p

    backend = create_backend("memory", task_dir="", options={})
    old_code, new_code = pipeline(0), pipeline(10)
    (rep,) = old_code.stages().repartitions.values()
    topic, stage = rep.topic, rep.downstream

    def task(p: Pipeline) -> Task:
        return Task(
            f"s{stage}-p0", p, {(topic, 0): 0}, backend, _Out(), worker_id="w", epoch=1,
            on_snapshot=lambda s: None, faults=FaultInjector(""), stage=stage, plan=p.stages(),
            topic_partitions={"in": 1, topic: 1}, time_state=None,
        )  # fmt: skip

    old = task(old_code)
    value = orjson.dumps({"k": "k", "t": 50})
    old.enqueue((topic, 0), [ListedMessage(topic, 0, 0, value, b"sk", 50)])
    old.run()
    assert backend.entry_count() > 0
    new = task(new_code)  # restored on the old code's state
    for watermark in (150, 10_000):
        new.on_watermark_record((topic, 0), WatermarkRecord("p0", watermark, False))
        new.run()
    assert backend.entry_count() == 0
