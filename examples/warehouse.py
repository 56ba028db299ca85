"""The running total written to Kafka, a Parquet table and PostgreSQL at once.

Every output goes to all three sinks; each commits exactly once behind the Kafka commit point:
``<prefix>customer-totals`` (Kafka), a Parquet table at ``$SNAPLINE_WAREHOUSE`` that Spark
reads (``python -m examples.spark_analytics $SNAPLINE_WAREHOUSE``), and, when
``$SNAPLINE_POSTGRES_DSN`` is set, the table ``$SNAPLINE_POSTGRES_TABLE`` (default
``customer_totals``; create it with ``CREATE TABLE customer_totals (customer text PRIMARY KEY,
total bigint, count bigint)``), upserted per customer and fenced by checkpoint id.

``SNAPLINE_EXAMPLE_STAGES``: 1 (default; orders keyed by customer in Kafka, no repartition), 2
(re-keyed by customer through a repartition topic), 3 (re-keyed twice: by order-id bucket,
then by customer); ``SNAPLINE_EXAMPLE_PARTITIONS`` sets the repartition topics' partitions.
``SNAPLINE_EXAMPLE_VARIANT`` (savepoint tests): ``upgraded`` (one added state, one added
operator), ``incompatible`` (a state of another kind), ``slow`` (the running total at ~0.5 ms
per record).

Run: ``snapline run examples.warehouse:pipeline``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from examples.running_total import RunningTotal
from snapline import (
    Context,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    ListState,
    ParquetSink,
    Pipeline,
    PostgresSink,
    ValueState,
)


class BucketSequence(KeyedProcessFunction):
    """Numbers the orders of each order-id bucket (state in the middle stage of the 3-stage
    variant); the order passes on with its number."""

    seen = ValueState("seen", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        n = self.seen.value() + 1
        self.seen.update(n)
        yield {**value, "bucket_seq": n}


class RunningTotalV2(RunningTotal):
    """The running total after an upgrade that added a state (savepoint tests)."""

    largest = ValueState("largest", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        self.largest.update(max(self.largest.value(), value["amount"]))
        yield from super().process(value, ctx)


class SlowRunningTotal(RunningTotal):
    """The running total at ~2,000 records/s per worker (savepoint tests: the stage before it
    runs ahead, so a savepoint finds records in flight in the repartition topic)."""

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        time.sleep(0.0005)
        yield from super().process(value, ctx)


class Audit(KeyedProcessFunction):
    """An operator added by an upgrade: counts outputs per customer, passes them on."""

    outputs = ValueState("outputs", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        self.outputs.update(self.outputs.value() + 1)
        yield value


class RunningTotalAsList(KeyedProcessFunction):
    """Incompatible with RunningTotal's savepoints: ``total`` became a list state."""

    total = ListState("total")

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        self.total.add(value["amount"])
        yield value


def build() -> Pipeline:
    env = os.environ.get
    prefix = env("SNAPLINE_EXAMPLE_PREFIX", "")
    pipeline = Pipeline(
        env("SNAPLINE_EXAMPLE_JOB", "warehouse"),
        checkpoint_interval=float(env("SNAPLINE_EXAMPLE_INTERVAL", "1.0")),
        state_backend=env("SNAPLINE_EXAMPLE_BACKEND", "memory"),
        retained_checkpoints=int(env("SNAPLINE_EXAMPLE_RETAINED", "3")),
        tolerable_failed_checkpoints=int(env("SNAPLINE_EXAMPLE_TOLERABLE", "3")),
        checkpoint_timeout=float(env("SNAPLINE_EXAMPLE_CHECKPOINT_TIMEOUT", "60")),
        # tests shorten it so that a broker outage can outlast it quickly
        kafka_config=(
            {"transaction.timeout.ms": int(env("SNAPLINE_EXAMPLE_TXN_TIMEOUT_MS", ""))}
            if env("SNAPLINE_EXAMPLE_TXN_TIMEOUT_MS")
            else None
        ),
    )
    orders = pipeline.source(KafkaSource(f"{prefix}orders", value_format="json"))
    if env("SNAPLINE_EXAMPLE_RAW"):  # a sink before key_by: every order as it came in
        orders.sink(KafkaSink(f"{prefix}orders-raw", value_format="json"))
    stages = env("SNAPLINE_EXAMPLE_STAGES", "1")
    partitions = int(env("SNAPLINE_EXAMPLE_PARTITIONS", "0")) or None
    if stages == "1":  # orders keyed by customer in Kafka: no repartition topic
        keyed = orders.key_by()
    elif stages == "2":  # orders keyed by anything: re-keyed by customer
        keyed = orders.key_by(lambda o: o["customer"], name="by-customer", partitions=partitions)
    elif stages == "3":  # re-keyed twice: numbered per order-id bucket, then per customer
        keyed = (
            orders.key_by(lambda o: o["order_id"] % 64, name="by-bucket", partitions=partitions)
            .process(BucketSequence())
            .key_by(lambda o: o["customer"], name="by-customer", partitions=partitions)
        )
    else:
        raise ValueError(f"SNAPLINE_EXAMPLE_STAGES={stages!r}: use 1, 2 or 3")
    variant = env("SNAPLINE_EXAMPLE_VARIANT", "")
    if variant == "upgraded":  # a savepoint upgrade: one added state, one added operator
        totals = keyed.process(RunningTotalV2(), uid="RunningTotal").process(Audit())
    elif variant == "incompatible":  # the same state name with another kind
        totals = keyed.process(RunningTotalAsList(), uid="RunningTotal")
    elif variant == "slow":  # the same operator and state, slower
        totals = keyed.process(SlowRunningTotal(), uid="RunningTotal")
    else:
        totals = keyed.process(RunningTotal())
    totals.sink(KafkaSink(f"{prefix}customer-totals", value_format="json"))
    if env("SNAPLINE_EXAMPLE_COUNTS"):  # a second branch of the keyed stream: orders per customer
        keyed.count(uid="OrderCount").sink(KafkaSink(f"{prefix}order-counts", value_format="json"))
    totals.sink(
        ParquetSink(
            env("SNAPLINE_WAREHOUSE", "warehouse/customer_totals"), checkpoint_column="checkpoint"
        )
    )
    dsn = env("SNAPLINE_POSTGRES_DSN")
    if dsn:
        totals.sink(
            PostgresSink(
                dsn,
                env("SNAPLINE_POSTGRES_TABLE", "customer_totals"),
                key_columns=["customer"],
                columns=["customer", "total", "count"],
            )
        )
    return pipeline


pipeline = build()
