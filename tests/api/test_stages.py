"""The graph compiled into stages: where repartition topics cut it, and the errors."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from snapline import (
    ConfigurationError,
    Context,
    KafkaSink,
    KafkaSource,
    KeyedCoProcessFunction,
    KeyedProcessFunction,
    Pipeline,
    ValueState,
)
from snapline.pipeline.stages import compile_stages, repartition_partition, task_id_for
from snapline.testing import Message, run_pipeline


class Total(KeyedProcessFunction):
    total = ValueState("total", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        t = self.total.value() + value["amount"]
        self.total.update(t)
        yield {"key": ctx.key, "total": t, "id": value["id"]}


class Enrich(KeyedCoProcessFunction):
    profile = ValueState("profile")

    def process_left(self, order: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        yield {**order, "tier": (self.profile.value() or {}).get("tier")}

    def process_right(self, profile: dict[str, Any], ctx: Context) -> None:
        self.profile.update(profile)


def test_a_source_keyed_pipeline_is_one_stage() -> None:
    p = Pipeline("job")
    p.source(KafkaSource("in", value_format="json")).key_by().process(Total()).sink(
        KafkaSink("out")
    )
    plan = compile_stages(p)
    assert len(plan.stages) == 1 and not plan.repartitions
    assert plan.stage_of_topics(["in"]) == {"in": 0}


def test_each_rekeying_key_by_starts_a_stage_and_names_its_topic() -> None:
    p = Pipeline("job")
    (
        p.source(KafkaSource("in", value_format="json"))
        .key_by(lambda v: v["id"])
        .process(Total())
        .key_by(lambda v: v["key"], name="by-key", partitions=6)
        .sink(KafkaSink("out"))
    )
    plan = compile_stages(p)
    assert len(plan.stages) == 3
    reps = sorted(plan.repartitions.values(), key=lambda r: r.upstream)
    assert [(r.topic, r.partitions, r.upstream, r.downstream) for r in reps] == [
        ("job.key_by-1.repartition", None, 0, 1),
        ("job.by-key.repartition", 6, 1, 2),
    ]
    assert plan.stage_of_topics(["in"]) == {
        "in": 0,
        "job.key_by-1.repartition": 1,
        "job.by-key.repartition": 2,
    }
    assert task_id_for(0, 3) == "p3" and task_id_for(2, 5) == "s2-p5"


def test_connect_of_two_rekeyed_streams_is_one_stage_reading_both_topics() -> None:
    p = Pipeline("job")
    orders = p.source(KafkaSource("orders", value_format="json")).key_by(lambda o: o["c"])
    profiles = p.source(KafkaSource("profiles", value_format="json")).key_by(lambda o: o["c"])
    orders.connect(profiles).process(Enrich()).sink(KafkaSink("out"))
    plan = compile_stages(p)
    assert len(plan.stages) == 2
    assert set(plan.stages[1].reads) == {"job.key_by-1.repartition", "job.key_by-2.repartition"}


def test_connect_of_a_rekeyed_with_a_source_keyed_stream_is_refused() -> None:
    p = Pipeline("job")
    orders = p.source(KafkaSource("orders", value_format="json")).key_by(lambda o: o["c"])
    profiles = p.source(KafkaSource("profiles", value_format="json")).key_by()
    orders.connect(profiles).process(Enrich()).sink(KafkaSink("out"))
    with pytest.raises(ConfigurationError, match="re-key both sides"):
        p.validate()


def test_different_declared_partitions_in_one_stage_are_refused() -> None:
    p = Pipeline("job")
    a = p.source(KafkaSource("a", value_format="json")).key_by(lambda o: o["c"], partitions=4)
    b = p.source(KafkaSource("b", value_format="json")).key_by(lambda o: o["c"], partitions=8)
    a.connect(b).process(Enrich()).sink(KafkaSink("out"))
    with pytest.raises(ConfigurationError, match="different partitions"):
        p.validate()


def test_duplicate_key_by_names_and_partitions_above_max_parallelism_are_refused() -> None:
    p = Pipeline("job")
    s = p.source(KafkaSource("a", value_format="json"))
    s.key_by(lambda o: o["c"], name="x").sink(KafkaSink("o1"))
    s.key_by(lambda o: o["d"], name="x").sink(KafkaSink("o2"))
    with pytest.raises(ConfigurationError, match="named 'x'"):
        p.validate()
    q = Pipeline("job2", max_parallelism=8)
    q.source(KafkaSource("a")).key_by(lambda o: o, partitions=9).sink(KafkaSink("o"))
    with pytest.raises(ConfigurationError, match="exceeds max_parallelism"):
        q.validate()
    with pytest.raises(ConfigurationError, match="re-keying key_by"):
        q.source(KafkaSource("b")).key_by(partitions=2)


def test_a_cycle_of_stages_through_union_is_refused() -> None:
    """Only a key_by feeding its own stage was refused: k (stage 2 -> 1) and m (1 -> 2) were
    accepted, and each stage's watermark, the minimum over the other's writers, never moved."""
    p = Pipeline("job")
    src = p.source(KafkaSource("in", value_format="json"))
    x1 = src.key_by(lambda v: v["a"], name="f").map(lambda v: v)
    x2 = src.key_by(lambda v: v["b"], name="g").map(lambda v: v)
    x2.key_by(lambda v: v["c"], name="k").union(x1).sink(KafkaSink("o1"))
    x1.key_by(lambda v: v["d"], name="m").union(x2).sink(KafkaSink("o2"))
    with pytest.raises(ConfigurationError, match="cycle of stages") as info:
        p.validate()
    message = str(info.value)
    assert "'k' (stage 2 -> 1)" in message and "'m' (stage 1 -> 2)" in message
    assert "'f'" not in message and "'g'" not in message
    assert "key the combined streams once instead" in message


def _writer_numbered_after_its_reader() -> Pipeline:
    """f 0 -> 1, g 0 -> 2, h 2 -> 1: the union merges h's stage into x's, numbered first."""
    p = Pipeline("job")
    src = p.source(KafkaSource("in", value_format="json"))
    x = src.key_by(lambda v: v["a"], name="f")
    y = src.key_by(lambda v: v["b"], name="g")
    w = y.map(lambda v: {**v, "via": "h"}).key_by(lambda v: v["c"], name="h")
    w.union(x.map(lambda v: {**v, "via": "f"})).sink(KafkaSink("out", value_format="json"))
    return p


def test_stages_in_dataflow_order_put_every_writer_before_its_reader() -> None:
    p = _writer_numbered_after_its_reader()
    p.validate()
    plan = p.stages()
    hops = {r.name: (r.upstream, r.downstream) for r in plan.repartitions.values()}
    assert hops == {"f": (0, 1), "g": (0, 2), "h": (2, 1)}  # the numbering stays
    assert [s.index for s in plan.in_dataflow_order()] == [0, 2, 1]
    p2 = Pipeline("job")
    (
        p2.source(KafkaSource("in", value_format="json"))
        .key_by(lambda o: o["id"])
        .key_by(lambda o: o["c"])
        .sink(KafkaSink("out"))
    )
    assert [s.index for s in p2.stages().in_dataflow_order()] == [0, 1, 2]


def test_key_group_ranges_map_to_contiguous_partitions() -> None:
    parts = [repartition_partition(g, 3, 128) for g in range(128)]
    assert parts == sorted(parts) and set(parts) == {0, 1, 2}
    assert all(abs(parts.count(i) - 128 / 3) < 1 for i in range(3))


def _orders(n: int) -> list[Message]:
    return [
        Message({"id": i, "c": f"c{i % 7}", "amount": i % 10}, key=str(i), partition=i % 3)
        for i in range(n)
    ]


def test_three_stages_give_the_same_output_with_and_without_crashes() -> None:
    def build() -> Pipeline:
        p = Pipeline("job")
        (
            p.source(KafkaSource("orders", value_format="json"))
            .key_by(lambda o: o["id"] % 5)
            .map(lambda o: {**o, "seen": True})
            .key_by(lambda o: o["c"])
            .process(Total())
            .sink(KafkaSink("out", value_format="json"))
        )
        return p

    clean = run_pipeline(build(), {"orders": _orders(400)}, checkpoint_every=37)
    crashed = run_pipeline(
        build(), {"orders": _orders(400)}, checkpoint_every=37, crash_after=[50, 51, 300, 640]
    )
    assert crashed.crashes == 4
    for result in (clean, crashed):
        outputs = result.outputs["out"]
        assert sorted(o["id"] for o in outputs) == list(range(400))
        finals = {o["key"]: o["total"] for o in outputs}
        assert finals == {f"c{c}": sum(i % 10 for i in range(400) if i % 7 == c) for c in range(7)}


def test_connected_streams_share_keyed_state() -> None:
    p = Pipeline("job")
    orders = p.source(KafkaSource("orders", value_format="json")).key_by(lambda o: o["c"])
    profiles = p.source(KafkaSource("profiles", value_format="json")).key_by(lambda o: o["c"])
    orders.connect(profiles).process(Enrich()).sink(KafkaSink("out", value_format="json"))
    result = run_pipeline(
        p,
        {
            "profiles": [{"c": "a", "tier": "gold"}, {"c": "b", "tier": "basic"}],
            "orders": [{"c": "a", "id": 1}, {"c": "b", "id": 2}, {"c": "z", "id": 3}],
        },
        checkpoint_every=1,
    )
    tiers = {o["id"]: o["tier"] for o in result.outputs["out"]}
    assert tiers[3] is None and len(tiers) == 3


def test_a_value_that_cannot_cross_a_repartition_topic_is_a_dead_letter() -> None:
    p = Pipeline("job")
    (
        p.source(KafkaSource("in", value_format="json"))
        .map(lambda v: {1, 2} if v == "bad" else v)
        .key_by(lambda v: "k")
        .sink(KafkaSink("out", value_format="json"))
    )
    result = run_pipeline(p, {"in": ["ok", "bad", "fine"]})
    assert result.outputs["out"] == ["ok", "fine"]
    assert len(result.dead_letters) == 1 and "repartition topic" in result.dead_letters[0][1]


@pytest.mark.parametrize("through", ["filter", "union"])
def test_a_branch_never_sees_another_branchs_output(through: str) -> None:
    """A map behind a filter or a union wrote its output into the Record objects the source
    also handed to another branch (filters and unions pass records on as they are): that
    branch's sink got {'mapped': 1} instead of 1."""
    pipeline = Pipeline("branches")
    source = pipeline.source(KafkaSource("in"))
    other = pipeline.source(KafkaSource("in2"))
    passed = source.filter(lambda v: True) if through == "filter" else source.union(other)
    passed.map(lambda v: {"mapped": v}).sink(KafkaSink("mapped"))
    source.sink(KafkaSink("raw"))
    run = run_pipeline(pipeline, {"in": [1, 2], "in2": [3]})
    assert run.outputs["raw"] == [1, 2]
    assert sorted(o["mapped"] for o in run.outputs["mapped"]) == (
        [1, 2] if through == "filter" else [1, 2, 3]
    )


def test_a_self_join_sees_each_input_as_it_was() -> None:
    class SelfJoin(KeyedCoProcessFunction):
        def process_left(self, value, ctx):
            yield {"left": value}

        def process_right(self, value, ctx):
            yield {"right": value}

    pipeline = Pipeline("self-join")
    source = pipeline.source(KafkaSource("in"))
    (
        source.filter(lambda v: v["n"] % 2 == 0)
        .key_by()
        .connect(source.key_by())
        .process(SelfJoin())
        .sink(KafkaSink("out"))
    )
    run = run_pipeline(pipeline, {"in": [Message({"n": 0}, key="k"), Message({"n": 1}, key="k")]})
    assert sorted(map(str, run.outputs["out"])) == sorted(
        map(str, [{"left": {"n": 0}}, {"right": {"n": 0}}, {"right": {"n": 1}}])
    )


@pytest.mark.parametrize("prefix", ["", "spark-r1-"])
def test_a_keyed_task_expects_watermarks_from_writers_named_like_itself(prefix: str) -> None:
    """A Spark run names its tasks spark-<run>-<task id>, and their watermark records carry
    that name; the keyed stage expected writers p0, p1 and ignored every record, so its
    watermark never moved and no window after a re-keying key_by fired in a bounded run."""
    from snapline.pipeline.runtime.faults import FaultInjector
    from snapline.pipeline.runtime.task import Task
    from snapline.pipeline.runtime.watermarks import UpstreamChannelClock
    from snapline.pipeline.state import create_backend

    pipeline = Pipeline("prefixed")
    (
        pipeline.source(KafkaSource("in", timestamp=lambda v: v["t"]))
        .key_by(lambda v: v["k"])
        .count()
        .sink(KafkaSink("out"))
    )
    plan = pipeline.stages()
    (rep,) = plan.repartitions.values()
    task = Task(
        f"{prefix}s1-p0",
        pipeline,
        {(rep.topic, 0): 0},
        create_backend("memory", task_dir="", options={}),
        SimpleNamespace(produce=None, direct_producer=None),  # type: ignore[arg-type]
        worker_id="w",
        epoch=1,
        on_snapshot=lambda snapshot: None,
        faults=FaultInjector(""),
        stage=1,
        plan=plan,
        topic_partitions={"in": 2, rep.topic: 1},
    )
    clock = task.clock.channels[(rep.topic, 0)]
    assert isinstance(clock, UpstreamChannelClock)
    assert clock.writers == {f"{prefix}p0", f"{prefix}p1"}
