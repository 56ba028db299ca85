"""The join example (examples/enrich_orders.py) on real workers under SIGKILLs: orders and
profile updates both flow and cross repartition topics; an independent read_committed reader
finds every order exactly once, the per-customer running totals add up, and each order carries
a tier its customer really had (or none yet)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.workers import WorkerProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARTITIONS = 4
CUSTOMERS = 300
TIERS = ["basic", "silver", "gold"]


def test_join_example_is_exactly_once_under_kills(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    create_topics(
        kafka_bootstrap,
        {f"{prefix}{t}": PARTITIONS for t in ("orders", "profiles", "enriched-orders")},
    )
    env = {
        "SNAPLINE_EXAMPLE_PREFIX": prefix,
        "SNAPLINE_EXAMPLE_JOB": unique_name,
        "SNAPLINE_EXAMPLE_INTERVAL": "0.3",
    }
    workers = [
        WorkerProcess(
            "examples.enrich_orders:pipeline",
            f"w{i}",
            kafka_bootstrap,
            tmp_path / "chk",
            tmp_path,
            env,
        )
        for i in range(2)
    ]
    tiers_given: dict[str, set[str]] = {}
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20})
    rng = random.Random(3)

    def profile_updates(n: int) -> None:
        for _ in range(n):
            customer = f"c{rng.randrange(CUSTOMERS):05d}"
            tier = rng.choice(TIERS)
            tiers_given.setdefault(customer, set()).add(tier)
            producer.produce(
                f"{prefix}profiles",
                orjson.dumps({"customer": customer, "tier": tier}),
                str(rng.random()).encode(),  # keyed by anything: the job re-keys them
            )
        producer.flush(30)

    expected: dict[str, int] = {}
    produced = 0
    stop = threading.Event()

    def produce() -> None:
        nonlocal produced
        while not stop.is_set() and produced < 60_000:
            profile_updates(50)
            totals = produce_orders(
                kafka_bootstrap,
                f"{prefix}orders",
                2_000,
                CUSTOMERS,
                start_id=produced,
                keyed_by_order=True,
            )
            for customer, amount in totals.items():
                expected[customer] = expected.get(customer, 0) + amount
            produced += 2_000
            time.sleep(0.3)

    for worker in workers:
        worker.start()
    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    kills = 0
    try:
        while kills < 12 or thread.is_alive():
            time.sleep(rng.uniform(0.5, 2.0))
            victim = rng.choice(workers)
            victim.kill()
            kills += 1
            time.sleep(rng.uniform(0.0, 0.5))
            victim.start()
        thread.join()
        outputs = read_committed(
            kafka_bootstrap, f"{prefix}enriched-orders", produced, timeout=180, settle=3.0
        )
        logs = "\n".join(f"--- {w.worker_id}\n{w.tail()}" for w in workers)
        result = verify_totals(outputs, expected, range(produced))
        assert result.ok, result.summary() + "\n" + logs
        wrong_tier = [
            o
            for o in outputs
            if o["tier"] is not None and o["tier"] not in tiers_given.get(o["customer"], set())
        ]
        assert not wrong_tier, f"orders with a tier their customer never had: {wrong_tier[:5]}"
        assert any(o["tier"] is not None for o in outputs), "no order was ever enriched"
    finally:
        stop.set()
        for worker in workers:
            worker.kill()
    assert kills >= 12
