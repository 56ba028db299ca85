"""Event-time windows: orders per customer per minute, and customer shopping sessions.

Orders ``{"order_id", "customer", "amount", "ts"}`` (``ts``: event time, ms) arrive keyed by
anything; the pipeline re-keys them by customer (a repartition topic: the window's watermark
is the minimum over every upstream task's), then

- ``<prefix>orders-per-minute``: a tumbling window per customer and minute with the number
  of orders and their total amount (an ``AggregateFunction``);
- ``<prefix>sessions``: a session window per customer (closed after ``gap`` ms without an
  order) with the number of orders.

Each result ``{"key", "start", "end", "value"}`` appears once the watermark passes the window's
end, exactly once (docs/time.md). Records later than that go to the dead-letter topic.

The per-minute rows ``{"customer", "window_start", "window_end", "orders", "amount"}`` also go
to a Parquet table at ``$SNAPLINE_WAREHOUSE`` and to the PostgreSQL table
``$SNAPLINE_POSTGRES_TABLE`` at ``$SNAPLINE_POSTGRES_DSN`` when those are set (upserted by
``(customer, window_start)``).

Environment (for tests and the demo): ``SNAPLINE_EXAMPLE_PREFIX``, ``SNAPLINE_EXAMPLE_JOB``,
``SNAPLINE_EXAMPLE_INTERVAL`` (checkpoint interval, s), ``SNAPLINE_EXAMPLE_BACKEND``,
``SNAPLINE_WINDOW_MS`` (60000), ``SNAPLINE_SESSION_GAP_MS`` (30000),
``SNAPLINE_OUT_OF_ORDERNESS_MS`` (5000), ``SNAPLINE_IDLE_TIMEOUT`` (s, 30),
``SNAPLINE_EXAMPLE_SESSIONS=0`` (no session window: one window, as ``snapline spark stream``
runs it).

Run: ``snapline run examples.windows:pipeline``.
"""

from __future__ import annotations

import os
from typing import Any

from snapline import (
    AggregateFunction,
    KafkaSink,
    KafkaSource,
    ParquetSink,
    Pipeline,
    PostgresSink,
    session,
    tumbling,
)


class OrderStats(AggregateFunction[dict[str, Any], dict[str, int], dict[str, int]]):
    """Number of orders and total amount."""

    def create_accumulator(self) -> dict[str, int]:
        return {"orders": 0, "amount": 0}

    def add(self, value: dict[str, Any], accumulator: dict[str, int]) -> dict[str, int]:
        return {
            "orders": accumulator["orders"] + 1,
            "amount": accumulator["amount"] + value["amount"],
        }

    def merge(self, a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {"orders": a["orders"] + b["orders"], "amount": a["amount"] + b["amount"]}

    def get_result(self, accumulator: dict[str, int]) -> dict[str, int]:
        return accumulator


def row(result: dict[str, Any]) -> dict[str, Any]:
    """A window result as a flat table row."""
    return {
        "customer": result["key"],
        "window_start": result["start"],
        "window_end": result["end"],
        "orders": result["value"]["orders"],
        "amount": result["value"]["amount"],
    }


def build() -> Pipeline:
    env = os.environ.get
    prefix = env("SNAPLINE_EXAMPLE_PREFIX", "")
    pipeline = Pipeline(
        env("SNAPLINE_EXAMPLE_JOB", "windows"),
        checkpoint_interval=float(env("SNAPLINE_EXAMPLE_INTERVAL", "1.0")),
        state_backend=env("SNAPLINE_EXAMPLE_BACKEND", "memory"),
    )
    orders = pipeline.source(
        KafkaSource(
            f"{prefix}orders",
            timestamp=lambda order: order["ts"],
            max_out_of_orderness=int(env("SNAPLINE_OUT_OF_ORDERNESS_MS", "5000")),
            idle_timeout=float(env("SNAPLINE_IDLE_TIMEOUT", "30")),
        )
    )
    by_customer = orders.key_by(lambda order: order["customer"], name="by-customer")
    per_minute = by_customer.window(tumbling(int(env("SNAPLINE_WINDOW_MS", "60000")))).aggregate(
        OrderStats()
    )
    per_minute.sink(KafkaSink(f"{prefix}orders-per-minute"))
    rows = per_minute.map(row)
    if env("SNAPLINE_WAREHOUSE"):
        rows.sink(ParquetSink(env("SNAPLINE_WAREHOUSE", "")))
    if env("SNAPLINE_POSTGRES_DSN"):
        rows.sink(
            PostgresSink(
                env("SNAPLINE_POSTGRES_DSN", ""),
                env("SNAPLINE_POSTGRES_TABLE", "orders_per_minute"),
                key_columns=["customer", "window_start"],
                columns=["customer", "window_start", "window_end", "orders", "amount"],
            )
        )
    if env("SNAPLINE_EXAMPLE_SESSIONS", "1") != "0":  # 0: one window (snapline spark stream)
        (
            by_customer.window(session(int(env("SNAPLINE_SESSION_GAP_MS", "30000"))))
            .count()
            .sink(KafkaSink(f"{prefix}sessions"))
        )
    return pipeline


pipeline = build()
