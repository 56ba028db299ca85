"""``snapline spark stream`` planning: what maps onto a Structured Streaming query, what is
refused at start (with a message naming the fix), and how a value runs through a chain."""

from __future__ import annotations

from typing import Any

import pytest

from snapline import (
    Context,
    KafkaSink,
    KafkaSource,
    KeyedCoProcessFunction,
    KeyedProcessFunction,
    Pipeline,
    ValueState,
    tumbling,
)
from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.spark.stream import Trigger
from snapline.pipeline.spark.stream_plan import Step, plan_stream, run_chain


class Total(KeyedProcessFunction):
    total = ValueState("total", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> Any:
        self.total.update(self.total.value() + value["amount"])
        yield {"key": ctx.key, "total": self.total.value()}


class WithTimer(Total):
    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        return None


def _to_key_by_0(into: list[Any]) -> Any:
    """``run_chain``'s ``emit_end`` for a plan with one key_by: appends to ``into``."""

    def emit(value: Any, k: int) -> None:
        assert k == 0, f"a value sent on to key_by {k} of a plan with one"
        into.append(value)

    return emit


def _pipeline(**kwargs: Any) -> Pipeline:
    return Pipeline("p", **kwargs)


def test_running_total_maps_onto_two_parts() -> None:
    p = _pipeline()
    totals = (
        p.source(KafkaSource("orders"))
        .filter(lambda o: o["amount"] > 0)
        .key_by(lambda o: o["customer"])
        .process(Total())
        .map(lambda r: r)
    )
    totals.sink(KafkaSink("totals"))
    plan = plan_stream(p)
    assert [s.kind for s in plan.pre] == ["pass", "filter"]
    assert [s.kind for s in plan.keyed] == ["pass", "process", "map"]
    assert plan.keyed[-1].sinks == (0,)
    assert len(plan.process_ids) == 1
    assert plan.sinks[0].name == "kafka:totals"


def test_a_window_or_a_timer_function_runs_in_event_time() -> None:
    p = _pipeline()
    p.source(KafkaSource("a")).key_by().window(tumbling(1000)).count().sink(KafkaSink("o"))
    plan = plan_stream(p)
    assert [s.kind for s in plan.keyed] == ["pass", "window"]
    assert plan.timed == plan.keyed[1].node_id
    p = _pipeline()
    p.source(KafkaSource("a")).key_by().process(WithTimer()).sink(KafkaSink("o"))
    assert plan_stream(p).timed is not None
    p = _pipeline()
    p.source(KafkaSource("a")).key_by().process(Total()).sink(KafkaSink("o"))
    assert plan_stream(p).timed is None


def test_stateless_pipeline_has_no_keyed_part() -> None:
    p = _pipeline()
    p.source(KafkaSource("in")).map(lambda v: v).sink(KafkaSink("out"))
    plan = plan_stream(p)
    assert plan.key_by is None and plan.keyed == ()
    assert plan.pre[-1].sinks == (0,)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda p: (
                p.source(KafkaSource("a"))
                .key_by()
                .window(tumbling(1000))
                .count()
                .process(WithTimer())
                .sink(KafkaSink("o"))
            ),
            "2 operators with timers",
        ),
        (
            lambda p: (
                p.source(KafkaSource("a"))
                .key_by(lambda v: v["x"])
                .process(Total())
                .key_by(lambda v: v["key"])
                .process(Total(), uid="second")
                .sink(KafkaSink("o"))
            ),
            "second key_by",
        ),
        (
            lambda p: (
                p.source(KafkaSource("a"))
                .union(p.source(KafkaSource("b", starting_position="latest")))
                .key_by()
                .process(Total())
                .sink(KafkaSink("o"))
            ),
            "different starting positions",
        ),
    ],
    ids=["two-timed", "two-stages", "two-starting-positions"],
)
def test_what_cannot_map_is_refused_at_start(build: Any, message: str) -> None:
    p = _pipeline()
    build(p)
    with pytest.raises(ConfigurationError, match="snapline spark stream cannot run") as info:
        plan_stream(p)
    assert message in str(info.value)


def test_branches_after_key_by_form_a_tree_of_the_same_key() -> None:
    p = _pipeline()
    keyed = p.source(KafkaSource("a")).key_by()
    totals = keyed.process(Total())
    totals.sink(KafkaSink("o"))
    totals.map(lambda v: v).sink(KafkaSink("o-mapped"))
    keyed.count().sink(KafkaSink("counts"))
    plan = plan_stream(p)
    assert [s.kind for s in plan.keyed] == ["pass", "process", "map", "process"]
    assert [s.next for s in plan.keyed] == [(1, 3), (2,), (), ()]
    assert [s.sinks for s in plan.keyed] == [(), (0,), (1,), (2,)]
    assert [sink.name for sink in plan.sinks] == ["kafka:o", "kafka:o-mapped", "kafka:counts"]
    assert len(plan.process_ids) == 2 and plan.timed is None


def test_a_branch_may_hold_the_one_timed_operator_but_not_two() -> None:
    p = _pipeline()
    keyed = p.source(KafkaSource("a")).key_by()
    keyed.process(Total()).sink(KafkaSink("o"))
    keyed.window(tumbling(1000)).count().sink(KafkaSink("w"))
    plan = plan_stream(p)
    assert plan.timed == plan.keyed[2].node_id
    keyed.process(WithTimer(), uid="timed").sink(KafkaSink("t"))
    with pytest.raises(ConfigurationError, match="2 operators with timers"):
        plan_stream(p)


def test_key_bys_side_by_side_each_start_their_own_keyed_records() -> None:
    """Two branches keyed their own ways run in one keyed part, grouped by key in one state
    store: each record starts at its key_by's step (``keyed_roots``)."""
    p = _pipeline()
    source = p.source(KafkaSource("a"))
    source.key_by().process(Total()).sink(KafkaSink("o"))
    source.map(lambda v: v).key_by().process(Total(), uid="other").sink(KafkaSink("o2"))
    plan = plan_stream(p)
    assert [s.kind for s in plan.pre] == ["pass", "map"]
    assert [s.next for s in plan.pre] == [(2, 1), (3,)]  # 2, 3: the first and second key_by
    assert len(plan.key_bys) == 2 and plan.key_by == plan.key_bys[0]
    assert [s.kind for s in plan.keyed] == ["pass", "process", "pass", "process"]
    assert plan.keyed_roots == (0, 2)
    ends: list[tuple[Any, int]] = []
    run_chain(
        plan.pre,
        [None, lambda v: v * 10],
        1,
        None,
        lambda s, v: None,
        lambda v, k: ends.append((v, k)),
    )
    assert ends == [(1, 0), (10, 1)]


def test_a_second_key_by_after_the_first_is_refused() -> None:
    p = _pipeline()
    keyed = p.source(KafkaSource("a")).key_by(lambda v: v["x"])
    keyed.process(Total()).sink(KafkaSink("o"))
    keyed.map(lambda v: v).key_by(lambda v: v["y"]).process(Total(), uid="y").sink(KafkaSink("o2"))
    with pytest.raises(ConfigurationError, match="second key_by after the first"):
        plan_stream(p)


class Enrich(KeyedCoProcessFunction):
    tier = ValueState("tier")

    def process_left(self, value: Any, ctx: Context) -> Any:
        yield {"order": value, "tier": self.tier.value()}

    def process_right(self, value: Any, ctx: Context) -> Any:
        self.tier.update(value)


def test_connected_streams_run_one_co_process_with_a_step_per_side() -> None:
    """``left.connect(right).process(fn)``: a step per side (``process_left`` and
    ``process_right`` of one function), both feeding the same sinks and steps."""
    p = _pipeline()
    orders = p.source(KafkaSource("orders")).key_by(lambda o: o["customer"])
    tiers = p.source(KafkaSource("tiers")).key_by(lambda t: t["customer"])
    orders.connect(tiers).process(Enrich()).map(lambda r: r).sink(KafkaSink("enriched"))
    plan = plan_stream(p)
    assert [s.kind for s in plan.keyed] == ["pass", "co_left", "map", "pass", "co_right"]
    assert plan.keyed_roots == (0, 3)
    assert plan.keyed[1].node_id == plan.keyed[4].node_id
    assert plan.keyed[1].next == plan.keyed[4].next == (2,)
    assert plan.keyed[2].sinks == (0,)
    assert len(plan.process_ids) == 1
    assert plan.timed is None

    class Fn:
        def process_left(self, v: Any, ctx: Any) -> Any:
            yield ("left", v)

        def process_right(self, v: Any, ctx: Any) -> Any:
            yield ("right", v)

    fn = Fn()
    fns = [None, fn, lambda r: r, None, fn]
    sunk: list[tuple[int, Any]] = []
    run_chain(plan.keyed, fns, 1, None, lambda s, v: sunk.append((s, v)), start=0)
    run_chain(plan.keyed, fns, 2, None, lambda s, v: sunk.append((s, v)), start=3)
    assert sunk == [(0, ("left", 1)), (0, ("right", 2))]


def test_branches_and_sinks_before_key_by_form_a_tree_with_one_way_to_the_key_by() -> None:
    p = _pipeline()
    source = p.source(KafkaSource("a"))
    source.sink(KafkaSink("raw"))
    big = source.filter(lambda v: v > 10)
    big.sink(KafkaSink("big"))
    big.map(lambda v: -v).sink(KafkaSink("negated"))
    source.map(lambda v: v * 2).key_by().process(Total()).sink(KafkaSink("o"))
    plan = plan_stream(p)
    assert [s.kind for s in plan.pre] == ["pass", "filter", "map", "map"]
    assert [s.next for s in plan.pre] == [(1, 3), (2,), (), (4,)]  # 4: the end, the key_by
    assert [s.sinks for s in plan.pre] == [(0,), (1,), (2,), ()]
    assert [sink.name for sink in plan.sinks] == [
        "kafka:raw",
        "kafka:big",
        "kafka:negated",
        "kafka:o",
    ]
    fns = [None, lambda v: v > 10, lambda v: -v, lambda v: v * 2]
    sunk: list[tuple[int, Any]] = []
    keyed: list[Any] = []
    for value in (5, 20):
        run_chain(plan.pre, fns, value, None, lambda s, v: sunk.append((s, v)), _to_key_by_0(keyed))
    assert sunk == [(0, 5), (0, 20), (1, 20), (2, -20)]
    assert keyed == [10, 40]


def test_sources_meet_at_a_union_each_record_starting_at_its_own_source() -> None:
    """Two sources with branches of their own meet at a union before key_by: the union is one
    step both feed, and each record starts at its source's step (``roots``)."""
    p = _pipeline()
    a = p.source(KafkaSource("a", max_out_of_orderness=100))
    b = p.source(KafkaSource(("b1", "b2"), max_out_of_orderness=2000))
    b.sink(KafkaSink("b-raw"))
    a.map(lambda v: v + 1).union(b.filter(lambda v: v > 0)).key_by().process(Total()).sink(
        KafkaSink("o")
    )
    plan = plan_stream(p)
    assert plan.topics == ["a", "b1", "b2"]
    assert plan.max_out_of_orderness == 2000  # the query's one watermark: the largest delay
    assert [s.kind for s in plan.pre] == ["pass", "map", "union", "pass", "filter"]
    assert plan.roots == (0, 3)
    assert [s.next for s in plan.pre] == [(1,), (2,), (5,), (4,), (2,)]  # 5: the key_by
    fns = [None, lambda v: v + 1, None, None, lambda v: v > 0]
    sunk: list[tuple[int, Any]] = []
    keyed: list[Any] = []
    for root, value in ((0, 1), (3, 5), (3, -5)):
        run_chain(
            plan.pre,
            fns,
            value,
            None,
            lambda s, v: sunk.append((s, v)),
            _to_key_by_0(keyed),
            start=root,
        )
    assert keyed == [2, 5]
    assert sunk == [(0, 5), (0, -5)]


def test_a_union_of_branches_of_one_keyed_stream_is_one_step() -> None:
    p = _pipeline()
    keyed = p.source(KafkaSource("a")).key_by()
    keyed.map(lambda v: v).union(keyed.filter(lambda v: v)).process(Total()).sink(KafkaSink("o"))
    plan = plan_stream(p)
    assert [s.kind for s in plan.keyed] == ["pass", "map", "union", "process", "filter"]
    assert [s.next for s in plan.keyed] == [(1, 4), (2,), (3,), (), (2,)]


def test_a_topic_read_by_two_sources_is_refused() -> None:
    """(By the pipeline's own validation, as for services.)"""
    p = _pipeline()
    p.source(KafkaSource("a")).union(p.source(KafkaSource(("b", "a")))).sink(KafkaSink("o"))
    with pytest.raises(
        ConfigurationError, match=r"topics \['a'\] are read by more than one source"
    ):
        plan_stream(p)


def test_a_chain_before_key_by_ends_at_the_key_by() -> None:
    p = _pipeline()
    p.source(KafkaSource("a")).sink(KafkaSink("raw")).map(lambda v: v + 1).key_by().process(
        Total()
    ).sink(KafkaSink("o"))
    plan = plan_stream(p)
    assert [(s.kind, s.sinks, s.next) for s in plan.pre] == [
        ("pass", (0,), (1,)),
        ("map", (), (2,)),
    ]
    sunk: list[tuple[int, Any]] = []
    keyed: list[Any] = []
    run_chain(
        plan.pre,
        [None, lambda v: v + 1],
        1,
        None,
        lambda s, v: sunk.append((s, v)),
        _to_key_by_0(keyed),
    )
    assert (sunk, keyed) == ([(0, 1)], [2])


def test_at_least_once_is_refused() -> None:
    p = _pipeline(guarantee="at_least_once")
    p.source(KafkaSource("a")).key_by().process(Total()).sink(KafkaSink("o"))
    with pytest.raises(ConfigurationError, match="exactly_once"):
        plan_stream(p)


def test_run_chain_feeds_sinks_and_the_end_in_order() -> None:
    steps = [
        Step("pass", 0, (0,)),
        Step("flat_map", 1),
        Step("filter", 2, (1,)),
        Step("map", 3, (2,)),
    ]
    fns = [None, lambda v: [v, v + 1, v + 2], lambda v: v % 2 == 0, lambda v: v * 10]
    sunk: list[tuple[int, Any]] = []
    ended: list[Any] = []
    run_chain(steps, fns, 4, None, lambda s, v: sunk.append((s, v)), _to_key_by_0(ended))
    assert sunk == [(0, 4), (1, 4), (2, 40), (1, 6), (2, 60)]
    assert ended == [40, 60]


def test_run_chain_runs_every_branch_depth_first() -> None:
    steps = [
        Step("pass", 0, (0,), (1, 3)),
        Step("map", 1, (1,), (2,)),
        Step("flat_map", 2, (2,), ()),
        Step("filter", 3, (3,), ()),
    ]
    fns = [None, lambda v: v * 10, lambda v: [v, v + 1], lambda v: v % 2 == 0]
    sunk: list[tuple[int, Any]] = []
    run_chain(steps, fns, 4, None, lambda s, v: sunk.append((s, v)))
    assert sunk == [(0, 4), (1, 40), (2, 40), (2, 41), (3, 4)]
    sunk.clear()
    run_chain(steps, fns, 3, None, lambda s, v: sunk.append((s, v)), start=1)  # a timer's
    assert sunk == [(1, 30), (2, 30), (2, 31)]


def test_run_chain_drops_what_a_step_yielded_before_it_raised() -> None:
    """As a service task: a process function or flat_map that yields, then raises, is a dead
    letter and outputs nothing of that call; the other branches run."""

    def half(v: int) -> Any:
        yield v
        raise ValueError("half")

    steps = [Step("pass", 0, (), (1, 2)), Step("flat_map", 1, (0,), ()), Step("map", 2, (1,), ())]
    sunk: list[tuple[int, Any]] = []
    failed: list[int] = []
    run_chain(
        steps,
        [None, half, lambda v: v + 1],
        4,
        None,
        lambda s, v: sunk.append((s, v)),
        on_error=lambda i, exc: failed.append(i),
    )
    assert sunk == [(1, 5)] and failed == [1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("processing-time=5s", Trigger(interval="5 seconds")),
        ("processing-time=250ms", Trigger(interval="250 milliseconds")),
        ("processing-time=0.5s", Trigger(interval="0.5 seconds")),
        ("available-now", Trigger(available_now=True)),
    ],
)
def test_trigger_parses(text: str, expected: Trigger) -> None:
    assert Trigger.parse(text) == expected


@pytest.mark.parametrize("text", ["5s", "processing-time=", "processing-time=5m", "once"])
def test_bad_trigger_names_the_forms(text: str) -> None:
    with pytest.raises(ConfigurationError, match="available-now"):
        Trigger.parse(text)


def _first_rows(p: Pipeline, raw: bytes, key: bytes = b"k") -> list[dict[str, Any]]:
    from snapline.pipeline.spark.stream_ops import _FirstPart

    part = _FirstPart(p, plan_stream(p))
    return part.rows("in", 0, 7, key, raw, 1_000, 2_000)


def _explode_on_two(v: Any) -> Any:
    if v == 2:
        raise ValueError("two")
    return str(v)


def test_before_key_by_a_value_whose_key_raises_is_a_dead_letter_and_the_others_go_on() -> None:
    import pickle

    p = _pipeline()
    p.source(KafkaSource("in", value_format="json")).flat_map(lambda v: [v, v + 1, v + 2]).key_by(
        _explode_on_two, name="by-thing"
    ).process(Total()).sink(KafkaSink("o"))
    rows = _first_rows(p, b"1")
    assert [pickle.loads(r["value"]) for r in rows if "value" in r] == [1, 3]
    assert [r["key"] for r in rows if "value" in r] == [b"s1", b"s3"]
    (dead,) = [r for r in rows if "reason" in r]
    assert dead["reason"] == "in[0]@7: by-thing raised ValueError('two')" and dead["raw"] == b"1"
    assert sorted(r["seq"] for r in rows) == [0, 1, 2]
    (bad,) = _first_rows(p, b"{not json")
    assert "in[0]@7: JSONDecodeError" in bad["reason"]


def test_with_key_by_the_outputs_to_sinks_before_it_pass_through_by_input_partition() -> None:
    import pickle

    from snapline.pipeline.spark.stream_ops import PASS_PREFIX

    p = _pipeline()
    source = p.source(KafkaSource("in", value_format="json"))
    source.sink(KafkaSink("raw"))
    source.key_by(lambda v: v["c"]).process(Total()).sink(KafkaSink("o"))
    keyed, passed = _first_rows(p, b'{"c": "x", "amount": 1}', key=b"kafka-key")
    assert keyed["key"] == b"sx" and "sink" not in keyed
    assert passed["key"] == PASS_PREFIX + b"0" and passed["sink"] == 0
    assert pickle.loads(passed["value"]) == {"c": "x", "amount": 1}
    assert passed["out_key"] == b"skafka-key", "the record's own key, as in a service task"
    assert (keyed["seq"], passed["seq"]) == (0, 1)


def test_without_key_by_an_operator_that_raises_loses_only_its_own_outputs() -> None:
    import pickle

    p = _pipeline()
    first = p.source(KafkaSource("in", value_format="json")).map(lambda v: v * 10, name="tens")
    first.sink(KafkaSink("tens"))
    first.map(_explode_on_two, name="fussy").sink(KafkaSink("fussy"))
    tens, fussy = _first_rows(p, b"2")  # 20 is not 2: both operators succeed
    assert (tens["sink"], pickle.loads(tens["value"])) == (0, 20)
    assert (fussy["sink"], pickle.loads(fussy["value"])) == (1, "20")
    p = _pipeline()
    first = p.source(KafkaSource("in", value_format="json")).map(lambda v: v, name="same")
    first.sink(KafkaSink("same"))
    first.map(_explode_on_two, name="fussy").sink(KafkaSink("fussy"))
    rows = _first_rows(p, b"2")
    assert [(r["sink"], r.get("reason") or pickle.loads(r["value"])) for r in rows] == [
        (0, 2),
        (-1, "in[0]@7: fussy raised ValueError('two')"),
    ]
    assert [r["n"] for r in rows] == [0, 1] and rows[1]["value"] == b"2"


def clock_pipeline() -> Pipeline:
    """Event time from ``t``; a filter before key_by; a timer function after it."""
    p = _pipeline()
    p.source(KafkaSource("in", value_format="json", timestamp=lambda v: v["t"])).filter(
        lambda v: v["t"] < 500
    ).key_by().process(WithTimer()).sink(KafkaSink("o"))
    return p


def test_with_timers_only_a_clock_row_per_batch_carries_the_watermark_column() -> None:
    """Spark drops a stateful operator's input rows that are behind its watermark, so no
    record row may carry the watermark column: one clock row per Arrow batch, with the largest
    event time of its decodable records (a filtered one too), moves the watermark."""
    import pyarrow as pa

    from snapline.pipeline.spark.stream_ops import CLOCK_KEY, CLOCK_SEQ, first_part

    def batch(*values: bytes) -> pa.RecordBatch:
        n = len(values)
        return pa.RecordBatch.from_pydict(
            {
                "topic": ["in"] * n,
                "partition": [0] * n,
                "offset": list(range(n)),
                "key": [b"k"] * n,
                "value": list(values),
                "ts": [1] * n,
                "now": [2] * n,
            }
        )

    out = list(
        first_part("tests.spark.test_stream_plan:clock_pipeline")(
            iter([batch(b'{"t": 300}', b'{"t": 900}', b"{bad"), batch(b"{bad")])
        )
    )
    first = out[0].to_pylist()
    clocks = [r for r in first if r["seq"] == CLOCK_SEQ]
    assert [(r["key"], r["ts"]) for r in clocks] == [(CLOCK_KEY, 900)], "900 was filtered out"
    records = [r for r in first if r["seq"] != CLOCK_SEQ]
    assert [r["ts"] for r in records] == [300, 1]  # the record kept, the dead letter
    assert all(r["key"] != CLOCK_KEY for r in records)
    # A batch without a decodable record moves no clock.
    assert all(r["seq"] != CLOCK_SEQ for r in out[1].to_pylist())


def test_a_union_of_a_stream_with_itself_is_refused() -> None:
    """A service task emits a record once per input of a union it came in by (twice here);
    Spark's one step would emit it once: refused rather than different."""
    p = _pipeline()
    source = p.source(KafkaSource("a"))
    source.union(source).sink(KafkaSink("o"))
    with pytest.raises(ConfigurationError, match="union 'union' of a stream with itself"):
        plan_stream(p)


def test_a_union_of_streams_from_before_and_after_key_by_is_refused_naming_the_union() -> None:
    p = _pipeline()
    source = p.source(KafkaSource("a"))
    keyed = source.key_by()
    keyed.process(Total()).map(lambda v: v).union(source.map(lambda v: v)).sink(KafkaSink("o"))
    with pytest.raises(ConfigurationError, match=r"\['union'\], which take streams from before"):
        plan_stream(p)
