"""Windows through snapline.testing: random out-of-order streams with random out-of-orderness
bounds and allowed lateness give exactly what a brute-force reference computes, window by
window (every emission, in order), for every window type, with and without crashes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapline import (
    AggregateFunction,
    ConfigurationError,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    KeyedStream,
    Pipeline,
    hopping,
    session,
    sliding,
    testing,
    tumbling,
)
from snapline.pipeline.windows import WindowAssigner
from snapline.testing import Message, run_pipeline
from tests.api.window_reference import (
    Event,
    FixedReference,
    Reference,
    SessionReference,
    SlidingReference,
)


class SumCount(AggregateFunction[int, list[int], list[int]]):
    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, value: int, accumulator: list[int]) -> list[int]:
        return [accumulator[0] + 1, accumulator[1] + value]

    def merge(self, a: list[int], b: list[int]) -> list[int]:
        return [a[0] + b[0], a[1] + b[1]]

    def get_result(self, accumulator: list[int]) -> list[int]:
        return accumulator


FOLDS: dict[str, Callable[[list[Any]], Any]] = {
    "count": len,
    "reduce": sum,
    "aggregate": lambda values: [len(values), sum(values)],
}


def finish(windowed: Any, how: str) -> KeyedStream:
    if how == "count":
        return windowed.count()  # type: ignore[no-any-return]
    if how == "reduce":
        return windowed.reduce(lambda a, b: a + b)  # type: ignore[no-any-return]
    return windowed.aggregate(SumCount())  # type: ignore[no-any-return]


def window_pipeline(
    assigner: WindowAssigner,
    how: str,
    *,
    out_of_orderness: int,
    lateness: int,
    backend: str = "memory",
) -> Pipeline:
    """Events {"k", "ts", "v"} keyed by their Kafka key k; the windows fold the v's."""
    pipeline = Pipeline("windows", state_backend=backend)
    source = pipeline.source(
        KafkaSource(
            "events",
            timestamp=lambda v: v["ts"],
            max_out_of_orderness=out_of_orderness,
            idle_timeout=None,
        )
    )
    keyed = source.map(lambda v: v["v"]).key_by()
    finish(keyed.window(assigner, allowed_lateness=lateness), how).sink(KafkaSink("results"))
    return pipeline


def messages(events: list[Event]) -> list[Message]:
    return [Message({"k": k, "ts": ts, "v": v}, key=k) for k, ts, v in events]


def by_window(results: list[dict[str, Any]]) -> dict[tuple[Any, int, int], list[Any]]:
    grouped: dict[tuple[Any, int, int], list[Any]] = defaultdict(list)
    for r in results:
        grouped[(r["key"], r["start"], r["end"])].append(r["value"])
    return dict(grouped)


events_strategy = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 100), st.integers(1, 9)),
    min_size=1,
    max_size=60,
)
common = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(
    assigner: WindowAssigner,
    reference: Reference,
    events: list[Event],
    how: str,
    out_of_orderness: int,
    lateness: int,
    crash: list[int],
    backend: str = "memory",
) -> testing.TestRun:
    """The pipeline's emissions per window, and its late records, equal the reference's."""
    reference.run(events, out_of_orderness)
    pipeline = window_pipeline(
        assigner, how, out_of_orderness=out_of_orderness, lateness=lateness, backend=backend
    )
    run = run_pipeline(
        pipeline, {"events": messages(events)}, checkpoint_every=7, crash_after=crash
    )
    assert by_window(run.outputs["results"]) == dict(reference.emitted)
    late = [reason for _, reason in run.dead_letters if "late record" in reason]
    assert len(late) == len(reference.late)
    assert len(run.dead_letters) == len(late)
    return run


@given(
    events=events_strategy,
    size=st.integers(1, 30),
    ooo=st.integers(0, 20),
    lateness=st.sampled_from([0, 0, 7, 25]),
    how=st.sampled_from(["count", "reduce", "aggregate"]),
    crash=st.lists(st.integers(1, 80), max_size=3),
)
@common
def test_tumbling_windows_match_the_reference(
    events: list[Event], size: int, ooo: int, lateness: int, how: str, crash: list[int]
) -> None:
    assigner = tumbling(size)
    reference = FixedReference(assigner.assign, FOLDS[how], lateness)
    check(assigner, reference, events, how, ooo, lateness, crash)


@given(
    events=events_strategy,
    size=st.integers(1, 30),
    step=st.integers(1, 30),
    ooo=st.integers(0, 20),
    lateness=st.sampled_from([0, 0, 7, 25]),
    how=st.sampled_from(["count", "reduce", "aggregate"]),
    crash=st.lists(st.integers(1, 80), max_size=3),
)
@common
def test_hopping_windows_match_the_reference(
    events: list[Event],
    size: int,
    step: int,
    ooo: int,
    lateness: int,
    how: str,
    crash: list[int],
) -> None:
    assigner = hopping(max(size, step), min(size, step))
    reference = FixedReference(assigner.assign, FOLDS[how], lateness)
    check(assigner, reference, events, how, ooo, lateness, crash)


@given(
    events=events_strategy,
    size=st.integers(1, 30),
    ooo=st.integers(0, 20),
    lateness=st.sampled_from([0, 0, 7, 25]),
    how=st.sampled_from(["count", "reduce", "aggregate"]),
    crash=st.lists(st.integers(1, 80), max_size=3),
)
@common
def test_sliding_windows_match_the_reference(
    events: list[Event], size: int, ooo: int, lateness: int, how: str, crash: list[int]
) -> None:
    check(
        sliding(size),
        SlidingReference(size, FOLDS[how], lateness),
        events,
        how,
        ooo,
        lateness,
        crash,
    )


@given(
    events=events_strategy,
    gap=st.integers(1, 20),
    ooo=st.integers(0, 20),
    lateness=st.sampled_from([0, 0, 7, 25]),
    how=st.sampled_from(["count", "reduce", "aggregate"]),
    crash=st.lists(st.integers(1, 80), max_size=3),
)
@common
def test_session_windows_match_the_reference(
    events: list[Event], gap: int, ooo: int, lateness: int, how: str, crash: list[int]
) -> None:
    check(
        session(gap), SessionReference(gap, FOLDS[how], lateness), events, how, ooo, lateness, crash
    )


@pytest.mark.parametrize("assigner", [tumbling(20), hopping(20, 5), sliding(20), session(10)])
def test_rocksdb_backend_gives_the_same_windows(assigner: WindowAssigner) -> None:
    events = [(k, (i * 37) % 200, i % 7 + 1) for i, k in enumerate("abcab" * 20)]
    if isinstance(assigner, type(session(1))):
        reference: Reference = SessionReference(10, len, 5)
    elif isinstance(assigner, type(sliding(1))):
        reference = SlidingReference(20, len, 5)
    else:
        reference = FixedReference(assigner.assign, len, 5)  # type: ignore[attr-defined]
    check(assigner, reference, events, "count", 30, 5, [33, 71], backend="rocksdb")


def test_windows_after_a_repartition_get_the_upstream_watermark() -> None:
    """key_by(fn) puts a repartition topic before the window: the window's task learns the
    watermark only from the upstream task's watermark records, and still emits every window
    (in order: nothing is late because the input is in order)."""
    pipeline = Pipeline("rekeyed")
    (
        pipeline.source(KafkaSource("events", timestamp=lambda v: v["ts"], idle_timeout=None))
        .key_by(lambda v: v["k"])
        .window(tumbling(10))
        .count()
        .sink(KafkaSink("results"))
    )
    events = [{"k": "abc"[i % 3], "ts": i} for i in range(100)]
    run = run_pipeline(pipeline, {"events": events}, checkpoint_every=10, end_watermark=False)
    results = by_window(run.outputs["results"])
    # Windows whose end the upstream watermark passed by the last checkpoint are all out,
    # each once; without end_watermark, the last ones are still open.
    assert results and all(
        v == [len([e for e in events if e["k"] == k and s <= e["ts"] < s + 10])]
        for (k, s, _), v in results.items()
    )
    assert max(s for _, s, _ in results) >= 70
    full = run_pipeline(pipeline, {"events": events}, checkpoint_every=10, crash_after=[35, 80])
    assert len(full.outputs["results"]) == 30 and not full.dead_letters


def test_window_arguments_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="step"):
        hopping(10, 20)
    with pytest.raises(ConfigurationError, match="milliseconds"):
        tumbling(1.5)  # type: ignore[arg-type]
    pipeline = Pipeline("bad")
    keyed = pipeline.source(KafkaSource("events")).key_by()
    with pytest.raises(ConfigurationError, match="on_late"):
        keyed.window(tumbling(10), on_late="ignore")
    with pytest.raises(ConfigurationError, match="assigner"):
        keyed.window(10)  # type: ignore[arg-type]


BOUNDARY_EVENTS: list[Event] = [
    ("a", 10, 1),  # watermark 9: [0, 10) fires
    ("a", 5, 2),  # end - 1 == watermark: late (or a late update within lateness)
    ("a", 9, 3),
    ("a", 20, 4),  # touches the session of 10 when gap 10
    ("a", 30, 5),
    ("a", 19, 6),
    ("a", 40, 7),
    ("a", 29, 8),
    ("a", 31, 9),
    ("b", 0, 1),
    ("b", 10, 1),
]


@pytest.mark.parametrize("lateness", [0, 1, 10])
@pytest.mark.parametrize("ooo", [0, 1])
def test_window_boundaries_match_the_reference(lateness: int, ooo: int) -> None:
    """Records exactly at a window's last millisecond, at the watermark, at end + lateness,
    and sessions exactly ``gap`` apart (they merge, as in Flink)."""
    for how in ("count", "reduce"):
        tumble, hop = tumbling(10), hopping(10, 5)
        check(
            tumble,
            FixedReference(tumble.assign, FOLDS[how], lateness),
            BOUNDARY_EVENTS,
            how,
            ooo,
            lateness,
            [],
        )
        check(
            hop,
            FixedReference(hop.assign, FOLDS[how], lateness),
            BOUNDARY_EVENTS,
            how,
            ooo,
            lateness,
            [4],
        )
        check(
            sliding(10),
            SlidingReference(10, FOLDS[how], lateness),
            BOUNDARY_EVENTS,
            how,
            ooo,
            lateness,
            [],
        )
        check(
            session(10),
            SessionReference(10, FOLDS[how], lateness),
            BOUNDARY_EVENTS,
            how,
            ooo,
            lateness,
            [6],
        )


class FailsOnTwo(AggregateFunction[dict[str, int], int, int]):
    """Counts; the result of a window of exactly two records raises (user code's bug)."""

    def create_accumulator(self) -> int:
        return 0

    def add(self, value: dict[str, int], accumulator: int) -> int:
        return accumulator + 1

    def get_result(self, accumulator: int) -> int:
        if accumulator == 2:
            raise ValueError("two")
        return accumulator

    def merge(self, a: int, b: int) -> int:
        return a + b


@pytest.mark.parametrize("windows", ["tumbling", "sliding", "session"])
def test_a_window_whose_result_raises_is_a_dead_letter_and_the_others_still_fire(
    windows: str,
) -> None:
    """Before, the error left the operator when the window fired: every retry of the epoch
    failed the same way and the job could not go on."""
    assigner = {"tumbling": tumbling(1000), "sliding": sliding(1000), "session": session(500)}
    pipeline = Pipeline("window-errors")
    (
        pipeline.source(KafkaSource("in", value_format="json", timestamp=lambda v: v["t"]))
        .key_by()
        .window(assigner[windows])
        .aggregate(FailsOnTwo())
        .sink(KafkaSink("out", value_format="json"))
    )
    events = [("a", 10), ("a", 20), ("b", 30), ("a", 5000)]
    run = run_pipeline(
        pipeline, {"in": [Message({"t": t}, key=k) for k, t in events]}, crash_after=(3,)
    )
    outputs = run.outputs["out"]
    assert all(o["value"] != 2 for o in outputs)
    assert {(o["key"], o["value"]) for o in outputs} >= {("b", 1), ("a", 1)}
    # Key a's window of two records, once (through the crash): no input bytes, the reason.
    [(value, reason)] = run.dead_letters
    assert value is None and "window [" in reason and "raised ValueError('two')" in reason


def test_a_late_record_whose_window_raises_again_is_counted_and_the_window_dead_lettered() -> None:
    """Within the allowed lateness a late record makes its window fire again at once. When
    that firing raises, the window is the dead letter (no input bytes), not the record: the
    record stays in the window's state, so the next firing counts it."""
    pipeline = Pipeline("late-window-errors")
    (
        pipeline.source(
            KafkaSource("in", value_format="json", timestamp=lambda v: v["t"], idle_timeout=None)
        )
        .key_by()
        .window(tumbling(1000), allowed_lateness=10_000)
        .aggregate(FailsOnTwo())
        .sink(KafkaSink("out", value_format="json"))
    )
    # a@10 fires [0, 1000) with 1 once a@5000 moves the watermark; a@20 (late, allowed) makes
    # it 2, whose result raises; a@30 makes it 3.
    events = [10, 5000, 20, 30]
    run = run_pipeline(
        pipeline, {"in": [Message({"t": t}, key="a") for t in events]}, crash_after=(3,)
    )
    first = [o["value"] for o in run.outputs["out"] if o["start"] == 0]
    assert first == [1, 3], "the late records are in the window's state, its firings in order"
    [(value, reason)] = run.dead_letters
    assert value is None, "the dead letter is the window, not the late record's bytes"
    assert "window [0, 1000)" in reason and "raised ValueError('two')" in reason


@pytest.mark.parametrize("factor", [2**30, 2**22 + 1])
def test_an_event_time_beyond_64_bits_is_a_dead_letter_not_a_failed_checkpoint(
    factor: int,
) -> None:
    """2**70 was taken as an event time: the watermark record could not be encoded at the next
    barrier (orjson: Integer exceeds 64-bit range), every checkpoint failed and every restart
    read the record again. Now the record is a dead letter naming it; the others go on."""
    pipeline = Pipeline("huge-time")
    (
        pipeline.source(
            KafkaSource("in", value_format="json", timestamp=lambda v: v["t"] * v.get("x", 1))
        )
        .key_by()
        .window(tumbling(1000))
        .count()
        .sink(KafkaSink("out", value_format="json"))
    )
    # 2**70: not 64 bits; just over 2**62: its window's end overflowed, after the watermark
    # had jumped to it (every later record late, for good).
    values = [{"t": 10}, {"t": 2**40, "x": factor}, {"t": 20}, {"t": 5000}]
    run = run_pipeline(pipeline, {"in": [Message(v, key="a") for v in values]})
    assert {(o["key"], o["value"]) for o in run.outputs["out"]} >= {("a", 2)}
    [(value, reason)] = run.dead_letters
    assert orjson.loads(value) == {"t": 2**40, "x": factor}
    assert "beyond ±2**62 ms" in reason


def test_a_window_of_windows_in_one_stage_loses_no_inner_window() -> None:
    """An inner window fires at watermark W and emits its result at time end - 1 <= W; the
    outer window in the same stage saw the task's watermark already at W and dropped the
    result as late: the last inner window of every outer window was lost (outer sums 16, 16,
    18 instead of 20), and all of them at the end of a bounded input. Each operator now has
    its own watermark, advanced after its upstream's output (as in Flink)."""
    pipeline = Pipeline("window-of-windows")
    source = pipeline.source(KafkaSource("in", timestamp=lambda v: v["ts"]))
    inner = source.key_by(lambda v: v["k"]).window(tumbling(10)).count()
    inner.sink(KafkaSink("inner"))
    outer = inner.window(tumbling(100)).reduce(lambda a, b: {**a, "value": a["value"] + b["value"]})
    outer.sink(KafkaSink("outer"))
    run = run_pipeline(
        pipeline, {"in": [{"k": "a", "ts": t} for t in range(0, 300, 5)]}, checkpoint_every=7
    )
    assert sum(o["value"] for o in run.outputs["inner"]) == 60 and not run.dead_letters
    assert [(o["start"], o["value"]["value"]) for o in run.outputs["outer"]] == [
        (0, 20),
        (100, 20),
        (200, 20),
    ]


def test_a_timers_output_reaches_a_window_in_the_same_stage() -> None:
    class Delay(KeyedProcessFunction):
        """Re-emits each record at the end of its 10 ms bucket, from an event-time timer."""

        def process(self, value: Any, ctx: Any) -> None:
            ctx.timers.register_event_time(ctx.timestamp // 10 * 10 + 9)

        def on_timer(self, timestamp: int, ctx: Any) -> Any:
            yield {"bucket_end": timestamp}

    pipeline = Pipeline("timer-into-window")
    (
        pipeline.source(KafkaSource("in", timestamp=lambda v: v["ts"]))
        .key_by(lambda v: v["k"])
        .process(Delay())
        .window(tumbling(10))
        .count()
        .sink(KafkaSink("out"))
    )
    run = run_pipeline(pipeline, {"in": [{"k": "a", "ts": t} for t in range(0, 100, 3)]})
    assert len(run.outputs["out"]) == 10 and not run.dead_letters


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_a_session_sum_that_overflows_is_a_dead_letter_and_the_session_stays(
    backend: str,
) -> None:
    """1e308 + 1e308 is inf, which JSON state stores as null: the session's sum read back as
    None (the window output value None, the next record a TypeError), and the merged session
    was removed before the refused value's write. Now the record that overflows is a dead
    letter naming inf, and the session goes on from its last finite sum."""
    p = Pipeline("s", state_backend=backend)
    src = p.source(KafkaSource("events", timestamp=lambda v: v["ts"], idle_timeout=None))
    src.map(lambda v: v["v"]).key_by().window(session(100)).reduce(lambda a, b: a + b).sink(
        KafkaSink("results")
    )
    events = [
        Message({"ts": 10, "v": 1e308}, key="a"),
        Message({"ts": 20, "v": 1e308}, key="a"),  # inf
        Message({"ts": 30, "v": 5.0}, key="a"),
    ]
    result = run_pipeline(p, {"events": events})
    assert result.outputs["results"] == [{"key": "a", "start": 10, "end": 130, "value": 1e308}]
    [(_, reason)] = result.dead_letters
    assert "[inf] cannot be stored as JSON" in reason


def test_a_window_result_refused_by_the_next_operator_is_the_dead_letters_value() -> None:
    """A window's result has no input record behind it and its state is gone once it fired:
    when a map after the window raises on it, the dead letter holds the result itself (it
    held nothing: the record's raw bytes, of which a result has none)."""

    def refuse(result: Any) -> Any:
        if result["key"] == "b":
            raise ValueError("no b")
        return result

    pipeline = Pipeline("refused-result")
    (
        pipeline.source(KafkaSource("in", value_format="json", timestamp=lambda v: v["t"]))
        .key_by()
        .window(tumbling(1000))
        .count()
        .map(refuse)
        .sink(KafkaSink("out", value_format="json"))
    )
    events = [("a", 10), ("b", 20), ("b", 30), ("a", 5000)]
    run = run_pipeline(pipeline, {"in": [Message({"t": t}, key=k) for k, t in events]})
    assert [(o["key"], o["value"]) for o in run.outputs["out"] if o["start"] == 0] == [("a", 1)]
    [(value, reason)] = run.dead_letters
    assert "raised ValueError('no b')" in reason
    assert value is not None
    assert orjson.loads(value) == {"key": "b", "start": 0, "end": 1000, "value": 2}


def late_drop_pipeline() -> Pipeline:
    """Tumbling windows of 1000 ms that drop late records; no dead-letter topic."""
    pipeline = Pipeline("late-drops", on_error="fail")
    (
        pipeline.source(
            KafkaSource("in", value_format="json", timestamp=lambda v: v["t"], idle_timeout=None)
        )
        .key_by()
        .window(tumbling(1000), on_late="drop")
        .count()
        .sink(KafkaSink("out", value_format="json"))
    )
    return pipeline


@pytest.mark.parametrize("crash", [(), (4,)])
def test_late_records_dropped_by_a_window_are_counted_in_the_run(crash: tuple[int, ...]) -> None:
    """on_late="drop" counted the late records in an attribute nothing read: the run (and the
    metrics, and the logs) showed nothing of them. The run counts those of committed
    checkpoints, so a crash does not count the ones it makes the task read again twice."""
    # 20 and 30 arrive when 5000 moved the watermark past [0, 1000); 40 after 6000.
    events = [10, 5000, 20, 30, 6000, 40]
    run = run_pipeline(
        late_drop_pipeline(),
        {"in": [Message({"t": t}, key="a") for t in events]},
        checkpoint_every=2,
        crash_after=crash,
    )
    assert [(o["start"], o["value"]) for o in run.outputs["out"]] == [(0, 1), (5000, 1), (6000, 1)]
    assert run.late_dropped == 3 and not run.dead_letters
    assert run.crashes == len(crash)


def test_late_records_dropped_are_logged_once_then_summarized(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first drop is logged with its times, the next ones as a count at most every
    LATE_LOG_INTERVAL seconds (late records can be many)."""
    from snapline.pipeline.runtime import window_operator

    events = [Message({"t": t}, key="a") for t in [10, 5000, 20, 30, 40]]
    with caplog.at_level("WARNING", logger=window_operator.__name__):
        run_pipeline(late_drop_pipeline(), {"in": events})
    [first] = [r.getMessage() for r in caplog.records]
    assert "dropped a late record" in first and "event time 20, watermark 4999" in first

    caplog.clear()
    monkeypatch.setattr(window_operator, "LATE_LOG_INTERVAL", 0.0)
    with caplog.at_level("WARNING", logger=window_operator.__name__):
        run_pipeline(late_drop_pipeline(), {"in": events})
    lines = [r.getMessage() for r in caplog.records]
    assert "dropped a late record" in lines[0]
    assert "late records dropped: 1 more" in lines[1] and "3 in all" in lines[-1]
