"""Timers in keyed process functions, through snapline.testing: event-time timers fire once
per registration when the watermark reaches them (a brute-force reference says which and
when), deleted timers never fire, processing-time timers fire from the wall clock, and a
crash changes nothing committed (timers are keyed state in the checkpoint)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapline import (
    Context,
    KafkaSink,
    KafkaSource,
    KeyedCoProcessFunction,
    KeyedProcessFunction,
    Pipeline,
    ValueState,
)
from snapline.testing import Message, run_pipeline

MIN = -(1 << 63)


class Reminder(KeyedProcessFunction):
    """Each record sets a reminder ``delay`` ms later (or cancels it); a reminder reports how
    many records its key had when it fired."""

    seen = ValueState("seen", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> None:
        assert ctx.timers is not None
        self.seen.update(self.seen.value() + 1)
        at = ctx.timestamp + value["delay"]
        if value["cancel"]:
            ctx.timers.delete_event_time(at)
        else:
            ctx.timers.register_event_time(at)

    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        assert ctx.time_domain == "event" and ctx.watermark >= timestamp
        yield {"key": ctx.key, "at": timestamp, "seen": self.seen.value()}


def reminder_pipeline(backend: str) -> Pipeline:
    pipeline = Pipeline("reminders", state_backend=backend)
    (
        pipeline.source(KafkaSource("events", timestamp=lambda v: v["ts"], max_out_of_orderness=5))
        .key_by()
        .process(Reminder())
        .sink(KafkaSink("fired"))
    )
    return pipeline


def reference(events: list[tuple[str, int, int, bool]]) -> list[tuple[str, int, int]]:
    timers: set[tuple[str, int]] = set()
    seen: dict[str, int] = {}
    fired = []
    watermark = max_ts = MIN

    def advance(to: int) -> None:
        for key, at in sorted(timers, key=lambda t: (t[1], t[0])):
            if at <= to:
                timers.discard((key, at))
                fired.append((key, at, seen[key]))

    for key, ts, delay, cancel in events:
        seen[key] = seen.get(key, 0) + 1
        (timers.discard if cancel else timers.add)((key, ts + delay))
        max_ts = max(max_ts, ts)
        if max_ts - 6 > watermark:
            watermark = max_ts - 6
            advance(watermark)
    advance((1 << 63) - 1)
    return sorted(fired)


@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.integers(0, 100),
            st.integers(0, 20),
            st.booleans(),
        ),
        max_size=50,
    ),
    crash=st.lists(st.integers(1, 60), max_size=3),
    backend=st.sampled_from(["memory", "rocksdb"]),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_event_time_timers_fire_once_per_registration(
    events: list[tuple[str, int, int, bool]], crash: list[int], backend: str
) -> None:
    inputs = [Message({"ts": ts, "delay": d, "cancel": c}, key=k) for k, ts, d, c in events]
    run = run_pipeline(
        reminder_pipeline(backend), {"events": inputs}, checkpoint_every=6, crash_after=crash
    )
    fired = sorted((o["key"], o["at"], o["seen"]) for o in run.outputs["fired"])
    assert fired == reference(events)


class Heartbeat(KeyedProcessFunction):
    """A processing-time timer per record (already due); fires on the next wall-clock check."""

    def process(self, value: Any, ctx: Context) -> None:
        assert ctx.timers is not None
        ctx.timers.register_processing_time(ctx.offset)

    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        assert ctx.time_domain == "processing"
        yield {"key": ctx.key, "offset": timestamp}


def test_processing_time_timers_fire_exactly_once_across_crashes() -> None:
    pipeline = Pipeline("heartbeat")
    (pipeline.source(KafkaSource("events")).key_by().process(Heartbeat()).sink(KafkaSink("beats")))
    inputs = [Message(i, key=f"k{i % 3}") for i in range(40)]
    run = run_pipeline(pipeline, {"events": inputs}, checkpoint_every=5, crash_after=[7, 23])
    beats = run.outputs["beats"]
    assert sorted(b["offset"] for b in beats) == list(range(40))
    assert all(b["key"] == f"k{b['offset'] % 3}" for b in beats)


class Timeout(KeyedCoProcessFunction):
    """Left: an order opens; right: its payment closes it (the two inputs arrive in any
    order); an order unpaid 10 ms after its event time times out."""

    deadline = ValueState("deadline")
    paid = ValueState("paid", default=False)

    def process_left(self, value: Any, ctx: Context) -> None:
        assert ctx.timers is not None
        if not self.paid.value():
            self.deadline.update(ctx.timestamp + 10)
            ctx.timers.register_event_time(ctx.timestamp + 10)

    def process_right(self, value: Any, ctx: Context) -> None:
        assert ctx.timers is not None
        self.paid.update(True)
        due = self.deadline.value()
        if due is not None:
            ctx.timers.delete_event_time(due)
            self.deadline.update(None)

    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        self.deadline.update(None)
        yield {"order": ctx.key, "timed_out_at": timestamp}


def test_timers_in_a_keyed_co_process_function() -> None:
    pipeline = Pipeline("payments")
    orders = pipeline.source(
        KafkaSource("orders", timestamp=lambda v: v["ts"], idle_timeout=None)
    ).key_by(lambda v: v["id"])
    payments = pipeline.source(
        KafkaSource("payments", timestamp=lambda v: v["ts"], idle_timeout=None)
    ).key_by(lambda v: v["id"])
    orders.connect(payments).process(Timeout()).sink(KafkaSink("timeouts"))
    order_events = [{"id": f"o{i}", "ts": i * 3} for i in range(20)]
    paid = [{"id": f"o{i}", "ts": i * 3 + 1} for i in range(20) if i % 2 == 0]
    for crash in ([], [9, 30]):
        run = run_pipeline(pipeline, {"orders": order_events, "payments": paid}, crash_after=crash)
        timed_out = sorted(r["order"] for r in run.outputs["timeouts"])
        assert timed_out == sorted(f"o{i}" for i in range(20) if i % 2 == 1)


class YieldsThenRaises(KeyedProcessFunction):
    """Yields a first half, then raises on odd values; its timer does the same."""

    def process(self, value: Any, ctx: Context) -> Any:
        yield {"half": 1, "v": value["v"]}
        if value["v"] % 2:
            raise ValueError("odd")
        yield {"half": 2, "v": value["v"]}
        ctx.timers.register_event_time(value["t"] + 10)

    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        yield {"timer": timestamp, "half": 1}
        if timestamp % 20:
            raise ValueError("odd timer")
        yield {"timer": timestamp, "half": 2}


def test_a_record_that_raises_after_yielding_outputs_nothing_of_it() -> None:
    """A generator that yielded, then raised, had its first outputs emitted and the record
    dead-lettered as well: half a result downstream beside a dead letter saying it failed.
    Now the dead letter is the record's only outcome (for a timer's firing too)."""
    pipeline = Pipeline("half")
    (
        pipeline.source(KafkaSource("in", value_format="json", timestamp=lambda v: v["t"]))
        .key_by(lambda v: v["k"])
        .process(YieldsThenRaises())
        .sink(KafkaSink("out", value_format="json"))
    )
    values = [{"k": "a", "v": v, "t": t} for v, t in [(2, 10), (3, 20), (4, 20), (6, 990)]]
    run = run_pipeline(pipeline, {"in": [Message(v) for v in values]})
    outputs = run.outputs["out"]
    assert [o for o in outputs if "v" in o] == [
        {"half": 1, "v": 2},
        {"half": 2, "v": 2},
        {"half": 1, "v": 4},
        {"half": 2, "v": 4},
        {"half": 1, "v": 6},
        {"half": 2, "v": 6},
    ]
    # Timers at 20 and 1000 (even: both halves) and 30 (odd: a dead letter, no half).
    assert [o for o in outputs if "timer" in o][:2] == [
        {"timer": 20, "half": 1},
        {"timer": 20, "half": 2},
    ]
    assert {"timer": 30, "half": 1} not in outputs
    reasons = [reason for _, reason in run.dead_letters]
    assert len(reasons) == 2 and "raised ValueError('odd')" in reasons[0]
    assert "on_timer(30) raised ValueError('odd timer')" in reasons[1]


class TimerResult(KeyedProcessFunction):
    """Outputs a result from a timer only (no input bytes behind it)."""

    def process(self, value: Any, ctx: Context) -> Any:
        ctx.timers.register_event_time(value["t"] + 10)
        return None

    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        yield {"from_timer": timestamp}


class HalfThenRaises(KeyedProcessFunction):
    def process(self, value: Any, ctx: Context) -> Any:
        yield {"partial": "half", "secret": "x"}
        raise ValueError("after half")


def test_the_dead_letter_of_a_timer_result_is_the_result_not_a_half_output() -> None:
    """The first output of a function reuses its input's Record in place: when the function
    then raised, the dead letter of an input without raw bytes (a timer's or window's
    result) held the half output the function meant to throw away, not its input."""
    pipeline = Pipeline("half-of-a-result")
    (
        pipeline.source(KafkaSource("in", value_format="json", timestamp=lambda v: v["t"]))
        .key_by(lambda v: v["k"])
        .process(TimerResult())
        .process(HalfThenRaises())
        .sink(KafkaSink("out", value_format="json"))
    )
    run = run_pipeline(pipeline, {"in": [Message({"k": "a", "t": 5})]})
    assert run.outputs["out"] == []
    [(value, reason)] = run.dead_letters
    assert "raised ValueError('after half')" in reason
    assert orjson.loads(value) == {"from_timer": 15}


def test_deleted_timers_do_not_pile_up_in_memory(monkeypatch: Any) -> None:
    """The inactivity-timeout pattern (each record deletes its key's timer and registers a new
    one) left every deleted timer in the firing heap until its time passed: 20,000 entries for
    10 live timers here, 180 million at 100,000 records/s with a 30-minute timeout. The heap
    is compacted once deleted entries are most of it."""
    import snapline.testing as harness
    from snapline.pipeline.runtime.operators import ProcessOperator

    class Timeout(KeyedProcessFunction):
        pending = ValueState("pending")

        def process(self, value: Any, ctx: Context) -> None:
            old = self.pending.value()
            if old is not None:
                ctx.timers.delete_processing_time(old)
            at = ctx.timers.current_processing_time() + 30 * 60_000
            ctx.timers.register_processing_time(at)
            self.pending.update(at)

    seen: dict[str, int] = {}
    close = harness.Task.close

    def measure(task: Any) -> None:
        for op in task.operators:
            if isinstance(op, ProcessOperator) and op._timers is not None:
                seen["heap"] = max(seen.get("heap", 0), len(op._timers._heaps[1]))
        close(task)

    monkeypatch.setattr(harness.Task, "close", measure)
    clock = iter(range(0, 10**9, 10))
    pipeline = Pipeline("timeouts")
    pipeline.source(KafkaSource("in")).key_by(lambda v: v % 10).process(Timeout()).sink(
        KafkaSink("out")
    )
    run_pipeline(
        pipeline,
        {"in": list(range(20_000))},
        checkpoint_every=5_000,
        processing_time=lambda: next(clock),
    )
    assert 10 <= seen["heap"] <= 2 * 1024 + 10


def test_a_periodic_timer_ends_at_the_end_of_a_bounded_input() -> None:
    """An on_timer that registers the next timer (every second) fired about 10**16 times when
    the watermark jumped to its maximum at the end of a bounded input (run_pipeline, spark
    run): it never ended. The end fires in rounds, at most END_ROUNDS of them."""
    from snapline.pipeline.runtime.timers import END_ROUNDS

    class Tick(KeyedProcessFunction):
        def process(self, value: Any, ctx: Context) -> None:
            ctx.timers.register_event_time(ctx.timestamp + 1000)

        def on_timer(self, timestamp: int, ctx: Context) -> Any:
            ctx.timers.register_event_time(timestamp + 1000)
            yield {"tick": timestamp}

    pipeline = Pipeline("ticks")
    (
        pipeline.source(KafkaSource("in", value_format="json", timestamp=lambda v: v["t"]))
        .key_by(lambda v: v["k"])
        .process(Tick())
        .sink(KafkaSink("out", value_format="json"))
    )
    run = run_pipeline(pipeline, {"in": [Message({"k": "a", "t": 0})]})
    assert len(run.outputs["out"]) == END_ROUNDS
