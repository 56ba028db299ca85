"""Input and verification for the running-total example: produce orders, check the totals.

Used by the demo and the integration tests. The check is independent of the pipeline: a
``read_committed`` consumer reads every output and compares it with the expected effect of
every input — each order counted exactly once, final totals equal to the sums.
"""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic


def create_topics(
    bootstrap: str, topics: dict[str, int], configs: dict[str, dict[str, str]] | None = None
) -> None:
    """Create ``topics`` (name -> partitions), each with its topic settings in ``configs``."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    configs = configs or {}
    # The broker's default.replication.factor: 1 on one broker, 3 on a local cluster.
    futures = admin.create_topics(
        [NewTopic(t, n, config=configs.get(t, {})) for t, n in topics.items()]
    )
    for future in futures.values():
        try:
            future.result()
        except Exception as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise


def produce_orders(
    bootstrap: str,
    topic: str,
    count: int,
    customers: int,
    *,
    start_id: int = 0,
    seed: int = 7,
    producer_config: dict[str, Any] | None = None,
    keyed_by_order: bool = False,
    flush_timeout: float = 60.0,
) -> dict[str, int]:
    """Produce ``count`` orders keyed by customer (``keyed_by_order``: by order id, so that a
    per-customer pipeline must re-key them); returns the expected total per customer.

    ``producer_config`` adds producer settings (``{"enable.idempotence": True}`` keeps retries
    across a broker restart from writing an order twice). ``flush_timeout``: seconds to wait
    for every order's delivery (RuntimeError after it)."""
    rng = random.Random(seed + start_id)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 20,
            "partitioner": "murmur2_random",
            "compression.type": "lz4",
            **(producer_config or {}),
        }
    )
    expected: dict[str, int] = defaultdict(int)
    for i in range(start_id, start_id + count):
        customer = f"c{rng.randrange(customers):05d}"
        amount = rng.randrange(1, 100)
        expected[customer] += amount
        value = orjson.dumps({"customer": customer, "amount": amount, "order_id": i})
        while True:
            try:
                producer.produce(
                    topic, value, str(i).encode() if keyed_by_order else customer.encode()
                )
                break
            except BufferError:
                producer.poll(0.05)
        if i % 5000 == 0:
            producer.poll(0)
    remaining = producer.flush(flush_timeout)
    if remaining:
        raise RuntimeError(
            f"{remaining} orders not delivered to {topic} within {flush_timeout:.0f} s"
        )
    return dict(expected)


@dataclass
class Verification:
    outputs: int = 0
    duplicates: list[Any] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    wrong_totals: dict[str, tuple[int, int]] = field(default_factory=dict)
    bad_sequences: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.missing or self.wrong_totals or self.bad_sequences)

    def summary(self) -> str:
        if self.ok:
            return f"OK: {self.outputs} outputs, every input counted exactly once"
        return (
            f"FAILED: {self.outputs} outputs, {len(self.duplicates)} duplicates "
            f"(e.g. {self.duplicates[:5]}), {len(self.missing)} missing "
            f"(e.g. {self.missing[:5]}), {len(self.wrong_totals)} wrong totals "
            f"(e.g. {list(self.wrong_totals.items())[:3]}), {len(self.bad_sequences)} "
            f"broken sequences (e.g. {list(self.bad_sequences.items())[:3]})"
        )


def read_committed(
    bootstrap: str, topic: str, expected_count: int, *, timeout: float = 120.0, settle: float = 2.0
) -> list[dict[str, Any]]:
    """Every committed output of ``topic`` (waits for ``expected_count``, then ``settle`` s)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"verify-{time.time_ns()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    metadata = consumer.list_topics(topic, timeout=30)
    partitions = list(metadata.topics[topic].partitions)
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    values: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    settle_until: float | None = None
    try:
        while time.monotonic() < deadline:
            batch = consumer.consume(5000, 0.5)
            for msg in batch:
                if msg.error() is None:
                    values.append(orjson.loads(msg.value()))
            if len(values) >= expected_count and settle_until is None:
                settle_until = time.monotonic() + settle
            if settle_until is not None and time.monotonic() > settle_until and not batch:
                break
    finally:
        consumer.close()
    return values


def verify_totals(
    outputs: list[dict[str, Any]], expected: dict[str, int], order_ids: Iterable[int]
) -> Verification:
    """Each order appears exactly once; per customer, counts run 1..n and totals add up."""
    result = Verification(outputs=len(outputs))
    seen = Counter(o["order_id"] for o in outputs)
    result.duplicates = sorted(i for i, n in seen.items() if n > 1)
    result.missing = [i for i in order_ids if i not in seen]
    by_customer: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for o in outputs:
        by_customer[o["customer"]].append(o)
    for customer, total in expected.items():
        rows = sorted(by_customer.get(customer, []), key=lambda r: r["count"])
        counts = [r["count"] for r in rows]
        if counts != list(range(1, len(rows) + 1)):
            result.bad_sequences[customer] = f"counts {counts[:10]}..."
        final = rows[-1]["total"] if rows else 0
        if final != total:
            result.wrong_totals[customer] = (final, total)
    return result
