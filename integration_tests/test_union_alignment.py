"""A union of two co-partitioned topics: barriers are aligned and the result is exactly once
through SIGKILLs. Orders are heavy and refunds light, so the refunds channel reaches each
barrier first and is held back until the orders channel delivers it."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.workers import WorkerProcess, read_events

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_union_of_two_topics_aligns_barriers_exactly_once(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    create_topics(
        kafka_bootstrap,
        {f"{prefix}orders": 2, f"{prefix}refunds": 2, f"{prefix}customer-totals": 2},
    )
    env = {
        "SNAPLINE_EXAMPLE_PREFIX": prefix,
        "SNAPLINE_EXAMPLE_JOB": unique_name,
        "SNAPLINE_EXAMPLE_INTERVAL": "0.2",
    }
    worker = WorkerProcess(
        "examples.running_total:with_refunds",
        "w0",
        kafka_bootstrap,
        tmp_path / "checkpoints",
        tmp_path,
        env,
    )
    expected: dict[str, int] = {}

    def add(totals: dict[str, int]) -> None:
        for customer, amount in totals.items():
            expected[customer] = expected.get(customer, 0) + amount

    worker.start()
    rng = random.Random(3)
    orders = refunds = 0
    for wave in range(12):
        add(produce_orders(kafka_bootstrap, f"{prefix}orders", 8000, 300, start_id=orders))
        orders += 8000
        # refunds: a second co-partitioned topic (same customers and keys), distinct ids
        refund_totals = produce_orders(
            kafka_bootstrap, f"{prefix}refunds", 300, 300, start_id=1_000_000 + refunds, seed=11
        )
        add(refund_totals)
        refunds += 300
        if wave % 3 == 2:
            time.sleep(rng.uniform(0.2, 1.0))
            worker.kill()
            worker.start()
    deadline = time.monotonic() + 120
    outputs: list = []
    while time.monotonic() < deadline:
        outputs = read_committed(
            kafka_bootstrap, f"{prefix}customer-totals", orders + refunds, timeout=20, settle=1.0
        )
        if len(outputs) >= orders + refunds:
            break
    worker.stop()
    ids = [*range(orders), *range(1_000_000, 1_000_000 + refunds)]
    result = verify_totals(outputs, expected, ids)  # type: ignore[arg-type]
    assert result.ok, result.summary() + "\n" + worker.tail()
    blocks = max(
        (
            e.get("alignment_blocks", 0)
            for e in read_events(worker.metrics_path)
            if e.get("event") == "checkpoint"
        ),
        default=0,
    )
    assert blocks > 0, "no barrier was ever aligned across the two inputs"
