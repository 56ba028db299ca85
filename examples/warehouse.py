"""The running total written to Kafka, a Parquet table and PostgreSQL at once.

Every output goes to all three sinks; each commits exactly once behind the Kafka commit point:
``<prefix>customer-totals`` (Kafka), a Parquet table at ``$SNAPLINE_WAREHOUSE`` that Spark
reads (``python -m examples.spark_analytics $SNAPLINE_WAREHOUSE``), and, when
``$SNAPLINE_POSTGRES_DSN`` is set, the table ``$SNAPLINE_POSTGRES_TABLE`` (default
``customer_totals``; create it with ``CREATE TABLE customer_totals (customer text PRIMARY KEY,
total bigint, count bigint)``), upserted per customer and fenced by checkpoint id.

Run: ``snapline run examples.warehouse:pipeline``.
"""

from __future__ import annotations

import os

from examples.running_total import RunningTotal
from snapline import KafkaSink, KafkaSource, ParquetSink, Pipeline, PostgresSink


def build() -> Pipeline:
    env = os.environ.get
    prefix = env("SNAPLINE_EXAMPLE_PREFIX", "")
    pipeline = Pipeline(
        env("SNAPLINE_EXAMPLE_JOB", "warehouse"),
        checkpoint_interval=float(env("SNAPLINE_EXAMPLE_INTERVAL", "1.0")),
        state_backend=env("SNAPLINE_EXAMPLE_BACKEND", "memory"),
        retained_checkpoints=int(env("SNAPLINE_EXAMPLE_RETAINED", "3")),
        tolerable_failed_checkpoints=int(env("SNAPLINE_EXAMPLE_TOLERABLE", "3")),
        # tests shorten it so that a broker outage can outlast it quickly
        kafka_config=(
            {"transaction.timeout.ms": int(env("SNAPLINE_EXAMPLE_TXN_TIMEOUT_MS", ""))}
            if env("SNAPLINE_EXAMPLE_TXN_TIMEOUT_MS")
            else None
        ),
    )
    totals = (
        pipeline.source(KafkaSource(f"{prefix}orders", value_format="json"))
        .key_by(lambda order: order["customer"])
        .process(RunningTotal())
    )
    totals.sink(KafkaSink(f"{prefix}customer-totals", value_format="json"))
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
