"""Rolling aggregations (``KeyedStream.count/reduce/aggregate``): every record emits its key's
result so far, exactly once through crashes; the service runtime's fast operator keeps the
same state entries, outputs and dead letters as the function run as a process function."""

from __future__ import annotations

import tracemalloc
from collections import defaultdict
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapline import (
    AggregateFunction,
    ConfigurationError,
    KafkaSink,
    KafkaSource,
    KeyedStream,
    Pipeline,
)
from snapline.pipeline.record import Record
from snapline.pipeline.rolling import RollingAggregate, rolling_aggregate, rolling_reduce
from snapline.pipeline.runtime import operators
from snapline.pipeline.runtime.operators import (
    Operator,
    ProcessOperator,
    RollingAggregateOperator,
)
from snapline.pipeline.state import create_backend
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.serde import JsonSerde
from snapline.pipeline.state.timers import TimerState
from snapline.testing import Message, run_pipeline


class SumCount(AggregateFunction[int, list[int], dict[str, int]]):
    """A dict result over a list accumulator: not a plain value, written through."""

    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, value: int, accumulator: list[int]) -> list[int]:
        accumulator[0] += 1  # in place, as user code may do
        accumulator[1] += value
        return accumulator

    def get_result(self, accumulator: list[int]) -> dict[str, int]:
        return {"n": accumulator[0], "sum": accumulator[1]}


class Mean(AggregateFunction[int, list[int], float]):
    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, value: int, accumulator: list[int]) -> list[int]:
        return [accumulator[0] + 1, accumulator[1] + value]

    def get_result(self, accumulator: list[int]) -> float:
        return accumulator[1] / accumulator[0]


def _add(a: int, b: int) -> int:
    return a + b


HOW = ("count", "reduce", "aggregate", "aggregate-dict")


def finish(keyed: KeyedStream, how: str) -> KeyedStream:
    if how == "count":
        return keyed.count()
    if how == "reduce":
        return keyed.reduce(_add)
    if how == "aggregate":
        return keyed.aggregate(Mean())
    return keyed.aggregate(SumCount())


def reference(how: str, events: list[tuple[str, int]]) -> list[dict[str, Any]]:
    seen: dict[str, list[int]] = defaultdict(list)
    out = []
    for key, v in events:
        seen[key].append(v)
        values = seen[key]
        result: Any = {
            "count": len(values),
            "reduce": sum(values),
            "aggregate": sum(values) / len(values),
            "aggregate-dict": {"n": len(values), "sum": sum(values)},
        }[how]
        out.append({"key": key, "value": result})
    return out


def rolling_pipeline(how: str, backend: str) -> Pipeline:
    pipeline = Pipeline("rolling", state_backend=backend)
    keyed = pipeline.source(KafkaSource("events", value_format="json")).key_by()
    finish(keyed, how).sink(KafkaSink("out", value_format="json"))
    return pipeline


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    how=st.sampled_from(HOW),
    events=st.lists(
        st.tuples(st.sampled_from("abcde"), st.integers(-1000, 1000)), min_size=1, max_size=60
    ),
    every=st.integers(1, 12),
    crashes=st.lists(st.integers(1, 60), max_size=3),
)
def test_each_record_emits_its_keys_result_so_far_exactly_once_through_crashes(
    how: str, events: list[tuple[str, int]], every: int, crashes: list[int]
) -> None:
    pipeline = rolling_pipeline(how, "memory")
    inputs = {"events": [Message(v, key=k) for k, v in events]}
    run = run_pipeline(pipeline, inputs, checkpoint_every=every, crash_after=crashes)
    assert run.outputs["out"] == reference(how, events)
    assert run.dead_letters == []


@pytest.mark.parametrize("how", HOW)
def test_rocksdb_keeps_the_same_results_through_a_crash(how: str) -> None:
    events = [(f"k{i % 7}", i) for i in range(80)]
    inputs = {"events": [Message(v, key=k) for k, v in events]}
    run = run_pipeline(
        rolling_pipeline(how, "rocksdb"), inputs, checkpoint_every=9, crash_after=(31, 50)
    )
    assert run.crashes == 2
    assert run.outputs["out"] == reference(how, events)


def ttl_reference(how: str, events: list[tuple[str, int, int]], ttl: int) -> list[dict[str, Any]]:
    """``reference`` where a key's values are forgotten ``ttl`` ms after its last update."""
    seen: dict[str, tuple[list[int], int]] = {}
    out = []
    for key, t, v in events:
        values, expiry = seen.get(key, ([], 0))
        if expiry <= t:
            values = []
        seen[key] = ([*values, v], t + ttl)
        out.extend(reference(how, [(key, x) for x in seen[key][0]])[-1:])
    return out


@settings(max_examples=30, deadline=None)
@given(
    how=st.sampled_from(HOW),
    steps=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(0, 15), st.integers(-50, 50)),
        min_size=1,
        max_size=40,
    ),
    ttl=st.integers(1, 30),
    crashes=st.lists(st.integers(1, 40), max_size=2),
    backend=st.sampled_from(["memory", "rocksdb"]),
)
def test_with_a_ttl_a_key_starts_again_once_its_accumulator_expired(
    how: str,
    steps: list[tuple[str, int, int]],
    ttl: int,
    crashes: list[int],
    backend: str,
) -> None:
    events, t = [], 1_000
    for key, dt, v in steps:
        t += dt  # processing time moves forward by the step (never back)
        events.append((key, t, v))
    now = [0]

    def clock(value: dict[str, int]) -> int:
        now[0] = value["t"]  # the processing time of this record, for the harness's clock
        return value["t"]

    expiry = timedelta(milliseconds=ttl)
    pipeline = Pipeline("rolling-ttl", state_backend=backend)
    keyed = pipeline.source(
        KafkaSource("events", value_format="json", timestamp=clock, idle_timeout=None)
    ).key_by()
    if how == "count":
        rolled = keyed.count(ttl=expiry)
    elif how == "reduce":
        rolled = keyed.reduce(lambda a, b: {"v": a["v"] + b["v"], "t": b["t"]}, ttl=expiry)
    else:
        rolled = keyed.aggregate(OfField(Mean() if how == "aggregate" else SumCount()), ttl=expiry)
    rolled.sink(KafkaSink("out", value_format="json"))
    inputs = {"events": [Message({"v": v, "t": t}, key=k) for k, t, v in events]}
    run = run_pipeline(
        pipeline, inputs, checkpoint_every=4, crash_after=crashes, processing_time=lambda: now[0]
    )
    outputs = run.outputs["out"]
    if how == "reduce":
        outputs = [{"key": o["key"], "value": o["value"]["v"]} for o in outputs]
    assert outputs == ttl_reference(how, events, ttl)
    assert run.dead_letters == []


class OfField(AggregateFunction[dict[str, int], Any, Any]):
    """An aggregate function of the records' ``v`` field."""

    def __init__(self, inner: AggregateFunction[int, Any, Any]) -> None:
        self.inner = inner

    def create_accumulator(self) -> Any:
        return self.inner.create_accumulator()

    def add(self, value: dict[str, int], accumulator: Any) -> Any:
        return self.inner.add(value["v"], accumulator)

    def get_result(self, accumulator: Any) -> Any:
        return self.inner.get_result(accumulator)


def test_the_accumulator_is_a_value_state_named_acc_under_the_operators_uid() -> None:
    pipeline = rolling_pipeline("count", "memory")
    node = next(n for n in pipeline.nodes if n.kind == "process")
    assert pipeline.operator_uids()[node.id] == "count"
    [(_, acc), (_, timers)] = pipeline.state_ids()[node.id]
    assert (acc.name, acc.kind, acc.serde.name) == ("acc", "value", "json")
    assert isinstance(timers, TimerState)
    custom = Pipeline("p").source(KafkaSource("t")).key_by()
    custom.aggregate(Mean(), serde="string", uid="mean").sink(KafkaSink("o"))
    [(_, acc), _] = custom._pipeline.state_ids()[custom._pipeline.nodes[-2].id]
    assert acc.serde.name == "string"


def test_misuse_fails_at_declaration_with_the_fix() -> None:
    stream = Pipeline("p").source(KafkaSource("t"))
    with pytest.raises(ConfigurationError, match=r"needs a keyed stream.*key_by"):
        stream.count()
    with pytest.raises(ConfigurationError, match=r"reduce\(\) needs a function"):
        stream.key_by().reduce(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"aggregate\(\) needs an AggregateFunction"):
        stream.key_by().aggregate(lambda a, b: a)  # type: ignore[arg-type]


# ------------------------------------------- the fast operator against the process function
class _Task:
    task_id = "0-0"
    epoch = 1
    watermark = -1

    def __init__(self) -> None:
        self.dead: list[tuple[Any, str]] = []

    def dead_letter(self, record: Record, reason: str, value: bytes | None = None) -> None:
        self.dead.append((record.value, reason))

    def now_ms(self) -> int:
        return 0


class _Collect(Operator):
    def __init__(self) -> None:
        self.values: list[Any] = []

    def process(self, records: list[Record]) -> None:
        self.values.extend(r.value for r in records)


def _records(events: list[tuple[str, Any]], start: int) -> list[Record]:
    out = []
    for i, (key, value) in enumerate(events):
        kb = key.encode()
        out.append(Record(value, 0, "t", 0, start + i, key, kb, len(kb) % 4, None, kb))
    return out


def _drive(
    fast: bool, function: RollingAggregate, epochs: list[list[tuple[str, Any]]]
) -> tuple[list[Any], list[tuple[Any, str]], list[dict[bytes, bytes]]]:
    """Run the epochs through one operator; the outputs, dead letters and, after each epoch's
    flush, the backend's entries."""
    pipeline = Pipeline("p")
    pipeline.source(KafkaSource("t")).key_by().process(function).sink(KafkaSink("o"))
    states = pipeline.state_ids()[pipeline.nodes[2].id]
    task = _Task()
    backend: KeyedStateBackend = create_backend("memory")
    op: Operator = (
        RollingAggregateOperator(task, "agg", function, states, backend)  # type: ignore[arg-type]
        if fast
        else ProcessOperator(task, "agg", function, states, backend, 128)  # type: ignore[arg-type]
    )
    op.owns_input = True
    out = _Collect()
    op.downstream.append(out)
    entries = []
    offset = 0
    for events in epochs:
        op.process(_records(events, offset))
        offset += len(events)
        op.flush_state()
        entries.append({k: v for k, _, v in backend.items()})
    return out.values, task.dead, entries


def _fussy(a: Any, b: Any) -> Any:
    if b == "boom":
        raise RuntimeError("boom")
    if b == "none":
        return None
    if b == "unencodable":
        return {1, 2}  # a set: not JSON
    if isinstance(a, str) or isinstance(b, str):
        return f"{a}{b}"
    if isinstance(a, dict) or isinstance(b, dict):
        return {"n": (a.get("n", 1) if isinstance(a, dict) else 1) + 1}
    return a + b


EVENT = st.tuples(
    st.sampled_from(["a", "b", "ccc", "d"]),
    st.one_of(
        st.integers(-5, 5),
        st.floats(-10, 10, allow_nan=False),
        st.sampled_from(["x", "boom", "none", "unencodable", {"n": 1}, 2**70]),
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    epochs=st.lists(st.lists(EVENT, max_size=12), min_size=1, max_size=5),
    cache_entries=st.sampled_from([1, 2, 50_000]),
)
def test_the_fast_operator_keeps_the_process_functions_state_outputs_and_dead_letters(
    epochs: list[list[tuple[str, Any]]], cache_entries: int
) -> None:
    # Ints, floats and strings are cached; dicts, big ints and sets are written through (or
    # fail to encode); errors and None go to the dead letters: each mixed per key.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(operators, "ROLLING_CACHE_ENTRIES", cache_entries)
        fast = _drive(True, rolling_reduce(_fussy), epochs)
    assert fast == _drive(False, rolling_reduce(_fussy), epochs)


def test_the_fast_operator_emits_results_that_later_records_do_not_change() -> None:
    epochs = [[("a", 1), ("a", 2), ("b", 5), ("a", 3)]]
    fast = _drive(True, rolling_aggregate(SumCount(), None), epochs)
    assert fast[0] == [
        {"key": "a", "value": {"n": 1, "sum": 1}},
        {"key": "a", "value": {"n": 2, "sum": 3}},
        {"key": "b", "value": {"n": 1, "sum": 5}},
        {"key": "a", "value": {"n": 3, "sum": 6}},
    ]
    assert fast == _drive(False, rolling_aggregate(SumCount(), None), epochs)


class PickySum(AggregateFunction[int, int, int]):
    def create_accumulator(self) -> int:
        return 0

    def add(self, value: int, accumulator: int) -> int:
        return accumulator + value

    def get_result(self, accumulator: int) -> int:
        if accumulator == 13:
            raise ValueError("unlucky")
        return accumulator


@pytest.mark.parametrize("fast", [True, False])
def test_a_record_whose_result_raises_is_a_dead_letter_with_no_effect_on_state(
    fast: bool,
) -> None:
    values, dead, entries = _drive(
        fast, rolling_aggregate(PickySum(), None), [[("a", 10), ("a", 3)], [("a", 1)]]
    )
    assert values == [{"key": "a", "value": 10}, {"key": "a", "value": 11}]
    assert [(v, "unlucky" in reason) for v, reason in dead] == [(3, True)]
    assert list(entries[-1].values()) == [b"11"]


def test_a_flush_stores_exact_size_values() -> None:
    """orjson's own result keeps a 4 KiB allocation behind a few bytes (serde.json_bytes): the
    values a flush leaves in the backend must be exact-size copies."""
    pipeline = Pipeline("p")
    function = rolling_reduce(_add)
    pipeline.source(KafkaSource("t")).key_by().process(function).sink(KafkaSink("o"))
    backend: KeyedStateBackend = create_backend("memory")
    op = RollingAggregateOperator(
        _Task(),  # type: ignore[arg-type]
        "agg",
        function,
        pipeline.state_ids()[pipeline.nodes[2].id],
        backend,
    )
    op.downstream.append(_Collect())
    keys = 5_000
    op.process(_records([(f"k{i}", i) for i in range(keys)], 0))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        op.flush_state()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(list(backend.items())) == keys
    assert grown < keys * 300, f"{grown / keys:.0f} bytes per stored value"


def test_a_flush_stores_what_the_serde_would() -> None:
    """Int accumulators are written as their digits without the serde's call: the bytes must
    be the serde's, and bools (ints to Python) must stay JSON's true and false."""
    accumulators = [0, 7, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**30, True, 1.5, 1e16, "x"]
    events = [(f"k{i}", acc) for i, acc in enumerate(accumulators)]
    _, dead, entries = _drive(True, rolling_reduce(_add), [events])
    assert dead == []
    assert sorted(entries[0].values()) == sorted(JsonSerde().dumps(a) for a in accumulators)


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_an_accumulator_that_overflows_to_inf_is_a_dead_letter_not_a_fresh_start(
    backend: str,
) -> None:
    """orjson stores inf and NaN as null, which read back as "no accumulator yet": a running
    product that overflowed started over from create_accumulator(), silently (1e200, inf,
    2.0, 6.0). Now the record that would overflow it is a dead letter and the state stays."""
    pipeline = Pipeline("product", state_backend=backend)
    (
        pipeline.source(KafkaSource("in", value_format="json"))
        .key_by(lambda v: "k")
        .reduce(lambda a, b: a * b)
        .sink(KafkaSink("out", value_format="json"))
    )
    run = run_pipeline(pipeline, {"in": [1e200, 1e200, 2.0, 3.0]})
    assert [o["value"] if isinstance(o, dict) else o for o in run.outputs["out"]] == [
        1e200,
        2e200,
        6e200,
    ]
    [(_, reason)] = run.dead_letters
    assert "cannot be stored as JSON" in reason


def test_a_key_switching_between_plain_and_other_accumulators_keeps_the_dirty_list_small() -> None:
    """Each switch to a non-plain accumulator (written through) left the key's dirty entry in
    the list and the next plain one added another: one entry per record until the barrier
    (10,000 records, one key: 5,000 entries). Stale entries are now dropped once they
    outnumber the cached keys."""
    from snapline.pipeline.state import create_backend

    class Task:
        task_id, epoch, watermark = "s1-p0", 1, 0

        def dead_letter(self, record: Any, reason: str, value: Any = None) -> None:
            raise AssertionError(reason)

        def now_ms(self) -> int:
            return 0

    latest = rolling_reduce(lambda a, b: b)
    pipeline = Pipeline("switch")
    pipeline.source(KafkaSource("t")).key_by().process(latest).sink(KafkaSink("o"))
    states = pipeline.state_ids()[pipeline.nodes[2].id]
    op = RollingAggregateOperator(Task(), "agg", latest, states, create_backend("memory"))  # type: ignore[arg-type]
    values = [1 if i % 2 else [1] for i in range(10_000)]
    op.process([Record(v, 0, "t", 0, i, "a", b"a", 1, None, b"a") for i, v in enumerate(values)])
    assert len(op._dirty) <= operators.STALE_DIRTY + 2
    op.flush_state()
    (entry,) = op._values.values()  # the last value, 1 (plain), cached and now stored
    assert op._get(entry[0]) == b"1"
