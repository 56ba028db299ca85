"""A bounded run's task is given its rows in offset order, one topic's after another's. There is
no Kafka to ask whether a partition is at its end, so a topic whose rows had not been handed
over yet went idle by the wall clock while they waited (``idle_timeout``), and they arrived
late: windows fired without them, depending on how fast the task ran (found by review). A
partition is at its end (``Feed.at_end``) only once all its rows were handed over."""

from __future__ import annotations

import time
from typing import Any

import orjson

from snapline import KafkaSink, KafkaSource, Pipeline, tumbling
from snapline.pipeline.runtime.faults import FaultInjector
from snapline.pipeline.runtime.task import Task
from snapline.pipeline.spark.bounded import Feed
from snapline.pipeline.state import create_backend


class _Output:
    """The task's Kafka output, kept in a list: (topic, value)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, Any]] = []

    def produce(self, epoch: int, topic: str, value: Any, key: Any, *args: Any, **kw: Any) -> None:
        self.records.append((topic, value))

    def direct_producer(self, epoch: int) -> None:
        return None


def _slow(value: Any) -> Any:
    time.sleep(0.002)  # 300 orders: 0.6 s, twice the idle timeout
    return value


def test_a_topic_whose_rows_come_later_is_not_idle_while_they_wait() -> None:
    pipeline = Pipeline("bounded-feed", state_backend="memory")
    source = KafkaSource(("orders", "refunds"), timestamp=lambda v: v["ts"], idle_timeout=0.3)
    (
        pipeline.source(source)
        .map(_slow)
        .key_by()
        .window(tumbling(1000))
        .count()
        .sink(KafkaSink("out"))
    )
    # Orders at offsets 0-299 (event times 0-2990), refunds at offsets 5000-5099 (0-990).
    rows = [("orders", o, b"c", orjson.dumps({"ts": o * 10}), o * 10) for o in range(300)]
    rows += [("refunds", 5000 + i, b"c", orjson.dumps({"ts": i * 10}), i * 10) for i in range(100)]
    rows.sort(key=lambda r: (r[1], r[0]))  # as run_bounded sorts a source task's rows
    output = _Output()
    feed = Feed(rows, 0)
    task = Task(
        "p0",
        pipeline,
        {("orders", 0): 0, ("refunds", 0): 0},
        create_backend("memory", task_dir="", options={}),
        output,  # type: ignore[arg-type]
        worker_id="spark",
        epoch=1,
        on_snapshot=lambda snapshot: None,
        faults=FaultInjector(""),
        plan=pipeline.stages(),
        topic_partitions={"orders": 1, "refunds": 1},
        source_ends=feed.at_end,
    )
    assert feed.into(task) == 400
    dead = [value for topic, value in output.records if topic != "out"]
    assert dead == [], f"{len(dead)} records went to the dead letters (late)"
    assert feed.at_end(("orders", 0)) and feed.at_end(("refunds", 0))
