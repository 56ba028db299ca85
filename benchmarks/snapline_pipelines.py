"""The Snapline pipelines that are benchmarked, declared against the public API.

Each attribute is a factory that ``snapline run benchmarks.snapline_pipelines:NAME`` calls; it
reads topics, job name, backend and guarantee from ``ChildEnv`` (``BENCH_*`` variables), so
the harness can run the same declaration on its own topics per run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from benchmarks.child_env import ChildEnv, StartMarker
from snapline.connectors import KafkaSource
from snapline.pipeline import AggregateFunction, KeyedProcessFunction, Pipeline, ValueState
from snapline.pipeline.functions import Context
from snapline.sinks import KafkaSink


class RunningTotal(KeyedProcessFunction):
    """The keyed running total every system in the benchmark computes."""

    total: ValueState[int] = ValueState("total", default=0)

    def __init__(self, start_file: str) -> None:
        self._marker = StartMarker(start_file)

    def process(self, value: Any, ctx: Context) -> Iterator[dict[str, Any]]:
        self._marker.mark()
        t = self.total.value() + value["amount"]
        self.total.update(t)
        yield {"customer": ctx.key, "total": t}


class Total(AggregateFunction[dict[str, Any], int, int]):
    """The running total as a rolling aggregate: ``key_by().aggregate(Total(...))`` emits
    ``{"key": customer, "value": total}`` (the verifier's ``rolling`` mode)."""

    def __init__(self, start_file: str) -> None:
        self._marker = StartMarker(start_file)

    def create_accumulator(self) -> int:
        return 0

    def add(self, value: dict[str, Any], accumulator: int) -> int:
        self._marker.mark()
        return accumulator + value["amount"]  # type: ignore[no-any-return]

    def get_result(self, accumulator: int) -> int:
        return accumulator


class RunningTotalWithNote(KeyedProcessFunction):
    """The recovery benchmark's variant: ~150 bytes of state per key."""

    last: ValueState[dict[str, Any]] = ValueState("last", default=None)

    def __init__(self, start_file: str) -> None:
        self._marker = StartMarker(start_file)

    def process(self, value: Any, ctx: Context) -> Iterator[dict[str, Any]]:
        self._marker.mark()
        last = self.last.value() or {"total": 0}
        t = last["total"] + value["amount"]
        self.last.update({"total": t, "note": value["note"]})
        yield {"customer": ctx.key, "total": t}


#: Extra librdkafka settings for the worker, as a JSON object (the handover benchmark's
#: ``--kafka-config``, e.g. a shorter ``transaction.timeout.ms``).
KAFKA_CONFIG_ENV = "BENCH_KAFKA_CONFIG"


def _pipeline(env: ChildEnv) -> Pipeline:
    return Pipeline(
        env.group,
        checkpoint_interval=env.commit_interval,
        state_backend=env.backend,
        guarantee=env.guarantee,
        checkpoint_dir=env.state_dir,
        kafka_config=json.loads(os.environ.get(KAFKA_CONFIG_ENV) or "{}"),
    )


def running_total() -> Pipeline:
    env = ChildEnv.from_environ()
    pipeline = _pipeline(env)
    (
        pipeline.source(KafkaSource(env.in_topic, value_format="json"))
        .key_by()  # the input is keyed by customer
        .process(RunningTotal(env.start_file))
        .sink(KafkaSink(env.out_topic, value_format="json"))
    )
    return pipeline


def running_total_aggregate() -> Pipeline:
    """The running total with the built-in rolling aggregate instead of a process function."""
    env = ChildEnv.from_environ()
    pipeline = _pipeline(env)
    (
        pipeline.source(KafkaSource(env.in_topic, value_format="json"))
        .key_by()  # the input is keyed by customer
        .aggregate(Total(env.start_file))
        .sink(KafkaSink(env.out_topic, value_format="json"))
    )
    return pipeline


def running_total_two_stages() -> Pipeline:
    """The stages suite: input keyed by order id, re-keyed by customer through the repartition
    topic ``<job>.by-customer.repartition`` (as many partitions as the input)."""
    env = ChildEnv.from_environ()
    pipeline = _pipeline(env)
    marker = StartMarker(env.start_file)

    def customer(value: dict[str, Any]) -> str:
        # The run starts when the first stage sees its first record, not when the second
        # stage does (that is after the first stage's first commit).
        marker.mark()
        return value["customer"]  # type: ignore[no-any-return]

    (
        pipeline.source(KafkaSource(env.in_topic, value_format="json"))
        .key_by(customer, name="by-customer")
        .process(RunningTotal(env.start_file))
        .sink(KafkaSink(env.out_topic, value_format="json"))
    )
    return pipeline


def running_total_with_note() -> Pipeline:
    env = ChildEnv.from_environ()
    pipeline = _pipeline(env)
    (
        pipeline.source(KafkaSource(env.in_topic, value_format="json"))
        .key_by()  # the input is keyed by customer
        .process(RunningTotalWithNote(env.start_file))
        .sink(KafkaSink(env.out_topic, value_format="json"))
    )
    return pipeline


def stateless_map() -> Pipeline:
    env = ChildEnv.from_environ()
    pipeline = _pipeline(env)
    marker = StartMarker(env.start_file)

    def project(value: dict[str, Any]) -> dict[str, Any]:
        marker.mark()
        return {"customer": value["customer"], "amount": value["amount"], "ts": value["ts"]}

    (
        pipeline.source(KafkaSource(env.in_topic, value_format="json"))
        .map(project)
        .sink(KafkaSink(env.out_topic, key=lambda v: v["customer"], value_format="json"))
    )
    return pipeline
