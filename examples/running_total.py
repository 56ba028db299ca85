"""Keyed running total: the amount per customer, exactly once.

Input  ``<prefix>orders``  JSON {"customer": "c7", "amount": 12, "order_id": 123}, keyed by
customer. Output ``<prefix>customer-totals`` JSON {"customer", "total", "count",
"order_id"} — one output per input, so a reader can check every input's effect.

Topic prefix, job name and backend come from the environment so tests and the demo can run
several copies side by side: SNAPLINE_EXAMPLE_PREFIX, SNAPLINE_EXAMPLE_JOB,
SNAPLINE_EXAMPLE_BACKEND, SNAPLINE_EXAMPLE_GUARANTEE, SNAPLINE_EXAMPLE_INTERVAL,
SNAPLINE_EXAMPLE_ON_CORRUPT. SNAPLINE_EXAMPLE_COUNTS=1 also writes a rolling count per
customer (``key_by().count()``) to ``<prefix>customer-counts`` as {"key", "value"}.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from snapline import Context, KafkaSink, KafkaSource, KeyedProcessFunction, Pipeline, ValueState


class RunningTotal(KeyedProcessFunction):
    """Adds each order's amount to its customer's total and emits the new total."""

    total = ValueState("total", default=0)
    count = ValueState("count", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        total = self.total.value() + value["amount"]
        count = self.count.value() + 1
        self.total.update(total)
        self.count.update(count)
        yield {
            "customer": ctx.key,
            "total": total,
            "count": count,
            "order_id": value.get("order_id"),
        }


def build(*, with_refunds: bool = False) -> Pipeline:
    """The running total; ``with_refunds`` also reads ``<prefix>refunds`` (negative amounts,
    co-partitioned with orders) through a union whose barriers are aligned."""
    env = os.environ.get
    prefix = env("SNAPLINE_EXAMPLE_PREFIX", "")
    pipeline = Pipeline(
        env("SNAPLINE_EXAMPLE_JOB", "running-total-refunds" if with_refunds else "running-total"),
        checkpoint_interval=float(env("SNAPLINE_EXAMPLE_INTERVAL", "1.0")),
        state_backend=env("SNAPLINE_EXAMPLE_BACKEND", "memory"),
        guarantee=env("SNAPLINE_EXAMPLE_GUARANTEE", "exactly_once"),
        on_corrupt_checkpoint=env("SNAPLINE_EXAMPLE_ON_CORRUPT", "fail"),
    )
    orders = pipeline.source(KafkaSource(f"{prefix}orders", value_format="json"))
    if with_refunds:
        orders = orders.union(pipeline.source(KafkaSource(f"{prefix}refunds", value_format="json")))
    # The orders are produced with the customer as Kafka message key, so key_by() (by the
    # message key) needs no repartition topic; SNAPLINE_EXAMPLE_STAGES=2 re-keys them with
    # key_by(fn) through one, as orders keyed by anything else would need.
    if env("SNAPLINE_EXAMPLE_STAGES", "1") == "2":
        keyed = orders.key_by(lambda order: order["customer"], name="by-customer")
    else:
        keyed = orders.key_by()
    totals = keyed.process(RunningTotal())
    totals.sink(KafkaSink(f"{prefix}customer-totals", value_format="json"))
    if env("SNAPLINE_EXAMPLE_COUNTS") == "1":
        keyed.count().sink(KafkaSink(f"{prefix}customer-counts", value_format="json"))
    return pipeline


def with_refunds() -> Pipeline:
    return build(with_refunds=True)


pipeline = build()
