"""A stream-stream join: orders enriched with the latest profile of their customer.

Orders (keyed by order id in Kafka) and customer profiles (keyed by anything) are both re-keyed
by customer through repartition topics and meet in one ``KeyedCoProcessFunction``: a profile
update is kept in keyed state; each order comes out with its customer's current tier and the
customer's running order total. Both inputs' effects are exactly once, whatever crashes.

Run: ``snapline run examples.enrich_orders:pipeline``; topics ``<prefix>orders``,
``<prefix>profiles`` (JSON ``{"customer": ..., "tier": ...}``) in, ``<prefix>enriched-orders``
out.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from snapline import (
    Context,
    KafkaSink,
    KafkaSource,
    KeyedCoProcessFunction,
    Pipeline,
    ValueState,
)


class EnrichWithProfile(KeyedCoProcessFunction):
    """Left: orders; right: profile updates of the same customer (the key)."""

    profile = ValueState("profile")
    total = ValueState("total", default=0)
    count = ValueState("count", default=0)

    def process_left(self, order: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        total = self.total.value() + order["amount"]
        count = self.count.value() + 1
        self.total.update(total)
        self.count.update(count)
        profile = self.profile.value() or {}
        yield {
            "customer": ctx.key,
            "order_id": order["order_id"],
            "amount": order["amount"],
            "tier": profile.get("tier"),
            "total": total,
            "count": count,
        }

    def process_right(self, profile: dict[str, Any], ctx: Context) -> None:
        self.profile.update(profile)


def build() -> Pipeline:
    env = os.environ.get
    prefix = env("SNAPLINE_EXAMPLE_PREFIX", "")
    pipeline = Pipeline(
        env("SNAPLINE_EXAMPLE_JOB", "enrich-orders"),
        checkpoint_interval=float(env("SNAPLINE_EXAMPLE_INTERVAL", "1.0")),
        state_backend=env("SNAPLINE_EXAMPLE_BACKEND", "memory"),
    )
    orders = pipeline.source(KafkaSource(f"{prefix}orders", value_format="json")).key_by(
        lambda order: order["customer"], name="orders-by-customer"
    )
    profiles = pipeline.source(KafkaSource(f"{prefix}profiles", value_format="json")).key_by(
        lambda profile: profile["customer"], name="profiles-by-customer"
    )
    enriched = orders.connect(profiles).process(EnrichWithProfile())
    enriched.sink(KafkaSink(f"{prefix}enriched-orders", value_format="json"))
    return pipeline


pipeline = build()
