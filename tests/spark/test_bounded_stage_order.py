"""A bounded run builds its stages in dataflow order. Union/connect number stages in order of
appearance: in ``f 0 -> 1, g 0 -> 2, h 2 -> 1`` stage 1 was built (by number) before stage 2
had produced h's records, so none of them reached stage 1 or its sink, and the run said
nothing. Here the stages run on a local Spark with real Snapline tasks (no Kafka: the sink's
records are kept)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson
import pytest

from snapline import KafkaSink, KafkaSource, Pipeline
from snapline.pipeline.spark.bounded import _stage_rdds

SOURCE_PARTITIONS = 2
STAGE_PARTITIONS = {0: SOURCE_PARTITIONS, 1: 3, 2: 2}


def _runner(build: Any) -> Any:
    """``runner(k)`` for ``_stage_rdds``: a Snapline task of stage k, as ``run_stage_task``
    runs it, that yields its sink's records as ``("sink", value)`` rows."""

    def for_stage(stage: int) -> Any:
        def run(partition: int, rows: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
            from snapline.pipeline.runtime.faults import FaultInjector
            from snapline.pipeline.runtime.task import Task
            from snapline.pipeline.spark.bounded import Feed, _Output
            from snapline.pipeline.stages import task_id_for
            from snapline.pipeline.state import create_backend

            pipeline = build()
            plan = pipeline.stages()
            repartitioned = {r.topic for r in plan.repartitions.values()}
            sunk: list[Any] = []

            class Output(_Output):
                def produce(self, epoch: int, topic: str, value: Any, key: Any, *a: Any) -> None:
                    if topic in repartitioned:
                        super().produce(epoch, topic, value, key, *a)
                    else:
                        sunk.append(value)

            output = Output(None, repartitioned)
            partitions = {"in": SOURCE_PARTITIONS}
            for rep in plan.repartitions.values():
                partitions[rep.topic] = STAGE_PARTITIONS[rep.downstream]
            reads = plan.stages[stage].reads or ("in",)
            feed = Feed(rows, partition)
            task = Task(
                task_id_for(stage, partition),
                pipeline,
                {(topic, partition): 0 for topic in reads},
                create_backend("memory", task_dir="", options={}),
                output,  # type: ignore[arg-type]
                worker_id="spark",
                epoch=1,
                on_snapshot=lambda snapshot: None,
                faults=FaultInjector(""),
                stage=stage,
                plan=plan,
                topic_partitions=partitions,
                source_ends=feed.at_end,
            )
            feed.into(task)
            task.inject_barrier(1)
            task.run()
            task.close()
            for value in sunk:
                yield ("sink", value)
            for seq, (topic, target, key, value, ts) in enumerate(output.shuffled):
                yield ("shuffle", topic, target, (stage, partition, seq), key, value, ts)

        return run

    return for_stage


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("snapline-bounded-stage-order")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def test_a_stage_numbered_before_the_stage_writing_its_topic_gets_every_record(spark: Any) -> None:
    def build() -> Pipeline:
        p = Pipeline("stage-order")
        src = p.source(KafkaSource("in", value_format="json"))
        x = src.key_by(lambda v: v["a"], name="f")
        y = src.key_by(lambda v: v["b"], name="g")
        w = y.map(lambda v: {**v, "via": "h"}).key_by(lambda v: v["c"], name="h")
        w.union(x.map(lambda v: {**v, "via": "f"})).sink(KafkaSink("out", value_format="json"))
        return p

    plan = build().stages()
    hops = {r.name: (r.upstream, r.downstream) for r in plan.repartitions.values()}
    assert hops == {"f": (0, 1), "g": (0, 2), "h": (2, 1)}
    n = 60
    rows = [
        (
            i % SOURCE_PARTITIONS,
            (
                "in",
                i // SOURCE_PARTITIONS,
                b"k",
                orjson.dumps({"id": i, "a": i % 5, "b": i % 3, "c": i % 7}),
                i,
            ),
        )
        for i in range(n)
    ]
    source = spark.sparkContext.parallelize(rows).partitionBy(SOURCE_PARTITIONS, lambda p: p)
    stage_rdds = _stage_rdds(plan, source, {}, STAGE_PARTITIONS, _runner(build))
    sunk = [
        orjson.loads(row[1])
        for result in stage_rdds.values()
        for row in result.filter(lambda r: r[0] == "sink").collect()
    ]
    for result in stage_rdds.values():
        result.unpersist()
    assert sorted((v["id"], v["via"]) for v in sunk) == sorted(
        (i, via) for i in range(n) for via in ("f", "h")
    )
