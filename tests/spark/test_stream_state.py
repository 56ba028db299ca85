"""The state mapping of ``snapline spark stream``: Snapline's five state types on Spark's state
variables (MapState on a Spark MapState, the others on a Spark ValueState each), event-time
timers and windows on Spark timers, driven through the keyed processor as Spark's
transformWithState drives it, with a small in-memory stand-in for Spark's state handle (the
real one runs in integration_tests/test_spark_stream.py).
"""

from __future__ import annotations

import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import Row

from snapline import (
    AggregateFunction,
    AggregatingState,
    Context,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    ListState,
    MapState,
    Pipeline,
    ReducingState,
    ValueState,
)
from snapline.pipeline.formats import tag_key
from snapline.pipeline.spark.stream_ops import keyed_processor, spark_state_name


class Mean(AggregateFunction[int, list[int], float]):
    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, value: int, accumulator: list[int]) -> list[int]:
        return [accumulator[0] + value, accumulator[1] + 1]

    def get_result(self, accumulator: list[int]) -> float:
        return accumulator[0] / accumulator[1]


class Everything(KeyedProcessFunction):
    count = ValueState("count", default=0)
    amounts = ListState("amounts")
    by_item = MapState("by_item")
    largest = ReducingState("largest", reduce_fn=max)
    mean = AggregatingState("mean", aggregate=Mean())

    def process(self, value: dict[str, Any], ctx: Context) -> Any:
        self.count.update(self.count.value() + 1)
        self.amounts.add(value["amount"])
        self.by_item.put(value["item"], self.by_item.get(value["item"], 0) + 1)
        self.largest.add(value["amount"])
        self.mean.add(value["amount"])
        yield {
            "key": ctx.key,
            "offset": ctx.offset,
            "count": self.count.value(),
            "amounts": self.amounts.get(),
            "items": dict(self.by_item.items()),
            "largest": self.largest.get(),
            "mean": self.mean.get(),
        }


def _importable(name: str, pipeline: Pipeline) -> str:
    """Register ``pipeline`` as the ``pipeline`` of a module ``name``; its spec, as
    ``keyed_processor`` imports it."""
    module = types.ModuleType(name)
    module.pipeline = pipeline  # type: ignore[attr-defined]
    sys.modules[name] = module
    return f"{name}:pipeline"


def _module() -> str:
    name = "_snapline_stream_state_test"
    pipeline = Pipeline("state-map")
    pipeline.source(KafkaSource("in")).key_by().process(Everything()).sink(KafkaSink("out"))
    return _importable(name, pipeline)


class _Handle:
    """Spark's StatefulProcessorHandle in memory: state variables and timers scoped to
    ``self.key``."""

    def __init__(self) -> None:
        self.key: Any = None
        self.data: dict[tuple[str, Any], Any] = {}
        self.created: dict[str, str] = {}
        self.calls = 0
        self.timers: set[tuple[Any, int]] = set()

    def registerTimer(self, ts: int) -> None:
        self.timers.add((self.key, ts))

    def deleteTimer(self, ts: int) -> None:
        self.timers.discard((self.key, ts))

    def listTimers(self) -> Any:
        return iter(sorted(ts for key, ts in self.timers if key == self.key))

    def getValueState(self, name: str, schema: str) -> Any:
        self.created[name] = "value"
        return _Value(self, name)

    def getMapState(self, name: str, key_schema: str, value_schema: str) -> Any:
        self.created[name] = "map"
        return _Map(self, name)


class _Value:
    def __init__(self, handle: _Handle, name: str) -> None:
        self.h, self.name = handle, name

    def get(self) -> tuple[bytes] | None:
        self.h.calls += 1
        value = self.h.data.get((self.name, self.h.key))
        return None if value is None else (value,)

    def update(self, row: tuple[bytes]) -> None:
        self.h.calls += 1
        self.h.data[(self.name, self.h.key)] = row[0]

    def clear(self) -> None:
        self.h.calls += 1
        self.h.data.pop((self.name, self.h.key), None)


class _Map:
    def __init__(self, handle: _Handle, name: str) -> None:
        self.h, self.name = handle, name

    def _entries(self) -> dict[bytes, bytes]:
        return self.h.data.setdefault((self.name, self.h.key), {})  # type: ignore[no-any-return]

    def getValue(self, key: tuple[bytes]) -> tuple[bytes] | None:
        value = self._entries().get(key[0])
        return None if value is None else (value,)

    def updateValue(self, key: tuple[bytes], value: tuple[bytes]) -> None:
        self._entries()[key[0]] = value[0]

    def removeKey(self, key: tuple[bytes]) -> None:
        self._entries().pop(key[0], None)

    def iterator(self) -> Iterator[tuple[tuple[bytes], tuple[bytes]]]:
        return iter([((k,), (v,)) for k, v in self._entries().items()])

    def clear(self) -> None:
        self._entries().clear()


def _row(key: str, offset: int, amount: int, item: str, now: int = 5000) -> Row:
    return Row(
        key=tag_key(key, key.encode()),
        topic="in",
        partition=0,
        offset=offset,
        seq=0,
        ts=1000 + offset,
        value=pickle.dumps({"amount": amount, "item": item}),
        raw=b"{}",
        raw_key=key.encode(),
        reason=None,
        now=now,
        entry=0,
    )


def _batch(processor: Any, handle: _Handle, key: str, rows: list[Row]) -> list[dict[str, Any]]:
    handle.key = key
    tagged = tag_key(key, key.encode())
    out = list(processor.handleInputRows((tagged,), iter(rows), None))
    assert all(r.sink == 0 and r.reason is None for r in out)
    return [pickle.loads(r.value) for r in out]


def _opened(spec: str) -> tuple[Any, _Handle]:
    """The keyed processor of the pipeline ``spec``, initialised on an in-memory handle."""
    processor = keyed_processor(spec)
    handle = _Handle()
    processor.init(handle)
    return processor, handle


@pytest.fixture
def processor_and_handle() -> tuple[Any, _Handle]:
    return _opened(_module())


def test_each_state_type_maps_onto_a_spark_state_variable(
    processor_and_handle: tuple[Any, _Handle],
) -> None:
    _, handle = processor_and_handle
    uid = "Everything"
    assert handle.created == {
        spark_state_name(uid, "count"): "value",
        spark_state_name(uid, "amounts"): "value",
        spark_state_name(uid, "by_item"): "map",
        spark_state_name(uid, "largest"): "value",
        spark_state_name(uid, "mean"): "value",
    }


def test_state_survives_batches_per_key_in_offset_order(
    processor_and_handle: tuple[Any, _Handle],
) -> None:
    processor, handle = processor_and_handle
    # Spark hands a key's rows in any order: the processor runs them in offset order.
    first = _batch(processor, handle, "a", [_row("a", 2, 5, "y"), _row("a", 1, 3, "x")])
    assert [o["offset"] for o in first] == [1, 2]
    assert first[-1]["count"] == 2 and first[-1]["amounts"] == [3, 5]
    assert _batch(processor, handle, "b", [_row("b", 7, 100, "x")])[0]["count"] == 1
    (last,) = _batch(processor, handle, "a", [_row("a", 9, 4, "x")])
    assert last == {
        "key": "a",
        "offset": 9,
        "count": 3,
        "amounts": [3, 5, 4],
        "items": {"x": 2, "y": 1},
        "largest": 5,
        "mean": 4.0,
    }


def test_value_states_are_read_once_and_written_once_per_key_and_batch(
    processor_and_handle: tuple[Any, _Handle],
) -> None:
    processor, handle = processor_and_handle
    rows = [_row("a", i, i, "x") for i in range(50)]
    _batch(processor, handle, "a", rows)
    # 4 value-backed states: at most one get and one update each, whatever the row count.
    assert handle.calls <= 8


def test_user_code_error_becomes_a_dead_letter_row(
    processor_and_handle: tuple[Any, _Handle],
) -> None:
    processor, handle = processor_and_handle
    bad = _row("a", 3, 1, "x")
    bad = Row(**{**bad.asDict(), "value": pickle.dumps({"item": "x"})})  # no amount
    handle.key = "a"
    (out,) = list(processor.handleInputRows((bad.key,), iter([bad]), None))
    assert out.sink == -1 and "KeyError" in out.reason and out.value == b"{}"


def test_outputs_of_the_part_before_key_by_pass_through_untouched(
    processor_and_handle: tuple[Any, _Handle],
) -> None:
    from snapline.pipeline.spark.stream_ops import PASS_PREFIX

    processor, handle = processor_and_handle
    rows = [
        Row(**{**_row("a", o, 1, "x").asDict(), "seq": 1, "sink": 3, "out_key": b"sk" + bytes([o])})
        for o in (2, 1)
    ]
    out = list(processor.handleInputRows((PASS_PREFIX + b"0",), iter(rows), None))
    assert [(r.offset, r.sink, r.key, r.reason) for r in out] == [
        (1, 3, b"sk\x01", None),
        (2, 3, b"sk\x02", None),
    ]
    assert [r.value for r in out] == [r.value for r in reversed(rows)]
    assert handle.calls == 0 and not handle.data, "no state is touched for them"


class _Watermark:
    """Spark's TimerValues of a batch: its watermark, and its timestamp (``now``)."""

    def __init__(self, watermark: int, now: int = 0) -> None:
        self.watermark = watermark
        self.now = now

    def getCurrentWatermarkInMs(self) -> int:
        return self.watermark

    def getCurrentProcessingTimeInMs(self) -> int:
        return self.now


class _Expired:
    def __init__(self, ts: int) -> None:
        self.ts = ts

    def getExpiryTimeInMs(self) -> int:
        return self.ts


def _fire(processor: Any, handle: _Handle, tagged: bytes, watermark: int, ts: int) -> list[Any]:
    """Spark firing the current key's timer ``ts`` at ``watermark``: its outputs; the timer is
    gone after it."""
    out = list(processor.handleExpiredTimer((tagged,), _Watermark(watermark), _Expired(ts)))
    handle.timers.discard((handle.key, ts))
    return out


def _windows_module() -> str:
    from snapline import tumbling

    name = "_snapline_stream_window_test"
    pipeline = Pipeline("window-map")
    (
        pipeline.source(KafkaSource("in"))
        .key_by()
        .window(tumbling(1000))
        .count()
        .map(lambda r: {"key": r["key"], "start": r["start"], "n": r["value"]})
        .sink(KafkaSink("out"))
    )
    return _importable(name, pipeline)


def _ts_row(key: str, offset: int, ts: int) -> Row:
    return Row(**{**_row(key, offset, 1, "x").asDict(), "ts": ts})


def test_a_window_registers_spark_timers_and_emits_when_they_fire() -> None:
    processor, handle = _opened(_windows_module())
    handle.key = "a"
    tagged = tag_key("a", b"a")
    rows = [_ts_row("a", 0, 100), _ts_row("a", 1, 900), _ts_row("a", 2, 1500)]
    assert list(processor.handleInputRows((tagged,), iter(rows), _Watermark(0))) == []
    assert handle.timers == {("a", 999), ("a", 1999)}  # each window's last millisecond
    out = list(_fire(processor, handle, tagged, 1200, 999))
    assert [pickle.loads(r.value) for r in out] == [{"key": "a", "start": 0, "n": 2}]
    assert out[0].topic == "~timer" and out[0].offset == 999  # after the batch's records
    # A record for a window the watermark passed is late: a dead letter with the reason.
    late = list(
        processor.handleInputRows((tagged,), iter([_ts_row("a", 3, 500)]), _Watermark(1200))
    )
    assert [r.sink for r in late] == [-1] and "late record" in late[0].reason


def test_records_before_the_batch_fires_a_window_join_it_and_it_fires_once() -> None:
    """Spark hands a batch's records over before it fires the timers its watermark passed: a
    window whose timer is due but has not fired has not fired. Its record joins it (as in a
    service task, where the watermark would have fired it only after this record had it) and
    the window is emitted once, by its timer; once fired, a record for it is late."""
    processor, handle = _opened(_windows_module())
    handle.key = "a"
    tagged = tag_key("a", b"a")
    assert (
        list(processor.handleInputRows((tagged,), iter([_ts_row("a", 0, 100)]), _Watermark(0)))
        == []
    )
    joined = processor.handleInputRows((tagged,), iter([_ts_row("a", 1, 200)]), _Watermark(1200))
    assert list(joined) == [], "the window was emitted before its timer fired"
    out = _fire(processor, handle, tagged, 1200, 999)
    assert [pickle.loads(r.value) for r in out] == [{"key": "a", "start": 0, "n": 2}]
    late = list(
        processor.handleInputRows((tagged,), iter([_ts_row("a", 2, 300)]), _Watermark(1200))
    )
    assert [r.sink for r in late] == [-1] and "late record" in late[0].reason


class Reminder(KeyedProcessFunction):
    """Remembers the last amount; an event-time timer 100 ms later emits it."""

    last = ValueState("last")

    def process(self, value: dict[str, Any], ctx: Context) -> Any:
        self.last.update(value["amount"])
        assert ctx.timers is not None
        ctx.timers.register_event_time(ctx.timestamp + 100)
        return None

    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        yield {
            "key": ctx.key,
            "at": timestamp,
            "last": self.last.value(),
            "domain": ctx.time_domain,
        }


def test_on_timer_runs_from_spark_expired_timers_with_the_keys_state() -> None:
    name = "_snapline_stream_timer_test"
    pipeline = Pipeline("timer-map")
    pipeline.source(KafkaSource("in")).key_by().process(Reminder()).sink(KafkaSink("out"))
    processor, handle = _opened(_importable(name, pipeline))
    handle.key = "b"
    tagged = tag_key("b", b"b")
    rows = [_ts_row("b", 0, 1000), _ts_row("b", 1, 1050)]
    assert list(processor.handleInputRows((tagged,), iter(rows), _Watermark(0))) == []
    assert handle.timers == {("b", 1100), ("b", 1150)}
    (out,) = _fire(processor, handle, tagged, 1120, 1100)
    assert pickle.loads(out.value) == {"key": "b", "at": 1100, "last": 1, "domain": "event"}


class ShortLived(Reminder):
    """``Reminder`` whose last amount is kept for 10 s (TTL)."""

    last = ValueState("last", ttl=10.0)


def test_a_timer_reads_ttl_state_at_its_batchs_time_not_the_wall_clock() -> None:
    """Found by review: a firing timer's state TTL went by the wall clock (the batch's time
    was set for records only), so a batch run again after a crash could find expired what
    its first run had read, and go on from other state than the committed output's. It
    reads at Spark's batch time now: a batch at 8 s sees the value written at 5 s with 10 s
    of TTL, one at 16 s does not, whatever the wall clock says."""
    name = "_snapline_stream_ttl_timer_test"
    pipeline = Pipeline("ttl-timer-map")
    pipeline.source(KafkaSource("in")).key_by().process(ShortLived()).sink(KafkaSink("out"))
    processor, handle = _opened(_importable(name, pipeline))
    handle.key = "b"
    tagged = tag_key("b", b"b")
    rows = [_row("b", 0, 7, "x", now=5000)]  # written at 5 s: expires at 15 s
    assert list(processor.handleInputRows((tagged,), iter(rows), _Watermark(0, 5000))) == []
    (ts,) = [t for _, t in handle.timers]
    fired = list(processor.handleExpiredTimer((tagged,), _Watermark(ts, 8000), _Expired(ts)))
    assert [pickle.loads(r.value)["last"] for r in fired] == [7]
    fired = list(processor.handleExpiredTimer((tagged,), _Watermark(ts, 16000), _Expired(ts)))
    assert [pickle.loads(r.value)["last"] for r in fired] == [None]


class ProcessingTimer(KeyedProcessFunction):
    def process(self, value: dict[str, Any], ctx: Context) -> Any:
        assert ctx.timers is not None
        ctx.timers.register_processing_time(1)
        return None

    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        return None


def test_a_processing_time_timer_fails_the_query_with_a_message() -> None:
    from snapline.pipeline.spark.stream_ops import UnmappedTimerError

    name = "_snapline_stream_ptimer_test"
    pipeline = Pipeline("ptimer")
    pipeline.source(KafkaSource("in")).key_by().process(ProcessingTimer()).sink(KafkaSink("o"))
    processor, handle = _opened(_importable(name, pipeline))
    handle.key = "c"
    rows = iter([_ts_row("c", 0, 10)])
    with pytest.raises(UnmappedTimerError, match="processing-time timers are not mapped"):
        list(processor.handleInputRows((tag_key("c", b"c"),), rows, _Watermark(0)))


class AmountSum(AggregateFunction[dict[str, Any], int, int]):
    def create_accumulator(self) -> int:
        return 0

    def add(self, value: dict[str, Any], accumulator: int) -> int:
        return accumulator + value["amount"]

    def get_result(self, accumulator: int) -> int:
        return accumulator


def test_a_rolling_aggregate_keeps_its_accumulator_in_a_spark_value_state() -> None:
    """``key_by().aggregate(..., ttl=)`` on Spark streaming: the accumulator is the Spark value
    state of the operator's uid and ``acc``, carried across batches and forgotten once its
    TTL passed in the batch's processing time."""
    name = "_snapline_stream_rolling_test"
    pipeline = Pipeline("rolling")
    keyed = pipeline.source(KafkaSource("in")).key_by()
    keyed.aggregate(AmountSum(), ttl=10.0, uid="sum").sink(KafkaSink("out"))
    processor, handle = _opened(_importable(name, pipeline))
    assert handle.created == {spark_state_name("sum", "acc"): "value"}

    first = _batch(processor, handle, "a", [_row("a", 2, 5, "y"), _row("a", 1, 3, "x")])
    assert first == [{"key": "a", "value": 3}, {"key": "a", "value": 8}]
    assert _batch(processor, handle, "b", [_row("b", 3, 100, "x")]) == [{"key": "b", "value": 100}]
    # Updated at 5,000 ms (10 s TTL): alive at 14,999 and updated; that update expires at 24,999.
    (alive,) = _batch(processor, handle, "a", [_row("a", 4, 4, "x", now=14_999)])
    assert alive == {"key": "a", "value": 12}
    (fresh,) = _batch(processor, handle, "a", [_row("a", 5, 7, "x", now=24_999)])
    assert fresh == {"key": "a", "value": 7}


def test_branches_after_key_by_share_the_key_and_keep_their_own_state() -> None:
    """A keyed stream feeding a running sum, a rolling count and a window: every record runs
    through each branch, each keeps its Spark state under its own uid, and a window timer's
    output goes to the window's branch only."""
    from snapline import tumbling

    name = "_snapline_stream_branches_test"
    pipeline = Pipeline("branches")
    keyed = pipeline.source(KafkaSource("in")).key_by()
    keyed.aggregate(AmountSum(), uid="sum").sink(KafkaSink("sums"))
    keyed.count(uid="n").sink(KafkaSink("counts"))
    keyed.window(tumbling(1000)).count().sink(KafkaSink("windows"))
    processor, handle = _opened(_importable(name, pipeline))
    assert set(handle.created) >= {spark_state_name("sum", "acc"), spark_state_name("n", "acc")}
    handle.key = "a"
    tagged = tag_key("a", b"a")
    rows = [_ts_row("a", 0, 100), _ts_row("a", 1, 900)]
    out = list(processor.handleInputRows((tagged,), iter(rows), _Watermark(0)))
    assert [(r.sink, r.offset, r.n, pickle.loads(r.value)) for r in out] == [
        (0, 0, 0, {"key": "a", "value": 1}),
        (1, 0, 1, {"key": "a", "value": 1}),
        (0, 1, 0, {"key": "a", "value": 2}),
        (1, 1, 1, {"key": "a", "value": 2}),
    ]
    assert handle.timers == {("a", 999)}
    fired = list(_fire(processor, handle, tagged, 1200, 999))
    assert [(r.sink, pickle.loads(r.value)["value"]) for r in fired] == [(2, 2)]
    again = list(processor.handleInputRows((tagged,), iter([_ts_row("a", 2, 1500)]), None))
    assert [(r.sink, pickle.loads(r.value)["value"]) for r in again] == [(0, 3), (1, 3)]


class FailsOnOdd(KeyedProcessFunction):
    """Counts, then raises for odd amounts (after yielding once for 3)."""

    seen = ValueState("seen", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> Any:
        self.seen.update(self.seen.value() + 1)
        if value["amount"] == 3:
            yield {"before": self.seen.value()}
        if value["amount"] % 2:
            raise ValueError(f"odd {value['amount']}")
        yield {"seen": self.seen.value()}


def test_a_branch_that_raises_is_a_dead_letter_of_its_own_and_the_others_go_on() -> None:
    """As in a service task, user code raising in one branch sends the record to the dead
    letters naming that operator; the other branch's output for the record is kept, and what
    the failing function yielded before it raised is not output (half a result)."""
    name = "_snapline_stream_branch_error_test"
    pipeline = Pipeline("branch-errors")
    keyed = pipeline.source(KafkaSource("in")).key_by()
    keyed.process(FailsOnOdd(), name="fussy").sink(KafkaSink("fussy"))
    keyed.count(uid="n").sink(KafkaSink("counts"))
    processor, handle = _opened(_importable(name, pipeline))
    handle.key = "a"
    tagged = tag_key("a", b"a")
    rows = [_row("a", 0, 2, "x"), _row("a", 1, 3, "x"), _row("a", 2, 4, "x")]
    out = [
        (r.offset, r.sink, r.reason or pickle.loads(r.value))
        for r in processor.handleInputRows((tagged,), iter(rows), None)
    ]
    assert out == [
        (0, 0, {"seen": 1}),
        (0, 1, {"key": "a", "value": 1}),
        (1, -1, "in[0]@1: fussy raised ValueError('odd 3')"),
        (1, 1, {"key": "a", "value": 2}),
        (2, 0, {"seen": 3}),
        (2, 1, {"key": "a", "value": 3}),
    ]


class Timed(KeyedProcessFunction):
    """Registers a timer 10 ms after each record; odd timers raise."""

    def process(self, value: dict[str, Any], ctx: Context) -> Any:
        ctx.timers.register_event_time(ctx.timestamp + 10)
        return ()

    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        yield {"fired": timestamp}
        if timestamp % 2:
            raise RuntimeError(f"timer {timestamp}")


def _explode(value: Any) -> Any:
    raise ValueError("no")


def test_a_timer_whose_function_or_branch_raises_leaves_dead_letters_and_the_rest() -> None:
    name = "_snapline_stream_timer_error_test"
    pipeline = Pipeline("timer-errors")
    timed = pipeline.source(KafkaSource("in")).key_by().process(Timed(), name="timed")
    timed.sink(KafkaSink("t"))
    timed.map(_explode, name="explode").sink(KafkaSink("x"))
    timed.map(lambda v: {**v, "same": True}, name="same").sink(KafkaSink("s"))
    processor, handle = _opened(_importable(name, pipeline))
    handle.key = "a"
    tagged = tag_key("a", b"a")
    rows = [_ts_row("a", 0, 1000), _ts_row("a", 1, 1001)]
    assert list(processor.handleInputRows((tagged,), iter(rows), _Watermark(0))) == []
    assert handle.timers == {("a", 1010), ("a", 1011)}

    def fire(ts: int) -> list[tuple[int, Any]]:
        out = _fire(processor, handle, tagged, 2000, ts)
        return [(r.sink, r.reason or pickle.loads(r.value)) for r in out]

    assert fire(1010) == [
        (-1, "timer 1010: explode raised ValueError('no')"),
        (0, {"fired": 1010}),
        (2, {"fired": 1010, "same": True}),
    ]
    # What on_timer yielded before it raised is output nowhere, as in a service task.
    assert fire(1011) == [
        (-1, "timer 1011: timed.on_timer(1011) raised RuntimeError('timer 1011')"),
    ]


def test_a_keys_rows_of_two_topics_interleave_by_time_each_partition_in_offset_order() -> None:
    """As a service task reads them: sorted by topic alone, every record of the topic whose
    name sorts first ran before the other's (a join's orders before its profile updates)."""
    from snapline.pipeline.spark.stream_ops import interleaved

    def row(topic: str, partition: int, offset: int, ts: int) -> Row:
        return Row(topic=topic, partition=partition, offset=offset, seq=0, ts=ts)

    rows = [
        row("orders", 0, 7, 30),
        row("orders", 0, 8, 10),  # an earlier time later in the partition: stays after 7
        row("orders", 1, 2, 20),
        row("profiles", 0, 4, 5),
        row("profiles", 0, 5, 25),
    ]
    order = [(r.topic, r.partition, r.offset) for r in interleaved(rows)]
    assert order == [
        ("profiles", 0, 4),
        ("orders", 1, 2),
        ("profiles", 0, 5),
        ("orders", 0, 7),
        ("orders", 0, 8),
    ]
    one = [row("a", 0, 1, 9), row("a", 0, 2, 1)]
    assert interleaved(one) == one


def test_the_commit_writes_a_keys_outputs_in_the_order_they_were_computed() -> None:
    """Found by review: a key's rows run interleaved by time across partitions, but the
    commit sorted outputs by (topic, partition, offset): a count computed 1, 2, 3 was written
    1, 3, 2, and the key's last output disagreed with its state. Outputs of the keyed part
    carry their position; other rows keep source order."""
    from snapline.pipeline.spark.stream_ops import OUT_FIELDS, output_order

    def out(partition: int, offset: int, count: int, pos: int | None, key: bytes | None) -> Any:
        row = dict.fromkeys(OUT_FIELDS)
        row.update(
            sink=0, topic="in", partition=partition, offset=offset, seq=0, n=0, ts=0, key=key
        )
        row.update(value=count, pos=pos)
        return tuple(row[f] for f in OUT_FIELDS)

    rows = [
        out(0, 1, 1, 0, b"sa"),
        out(0, 2, 3, 2, b"sa"),
        out(1, 1, 2, 1, b"sa"),
        out(1, 0, 9, None, b"sa"),  # a pass-through output: source order, before the keyed
        out(0, 0, 8, None, b"sa"),
    ]
    value = OUT_FIELDS.index("value")
    assert [r[value] for r in sorted(rows, key=output_order)] == [8, 9, 1, 2, 3]
