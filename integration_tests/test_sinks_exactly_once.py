"""Kafka, a Parquet table and PostgreSQL at once, through SIGKILLs: every sink shows each
input's effect exactly once — checked by Spark on the table, SQL on the database and a
read_committed consumer on the topic. A Spark reader polls the table while workers die and
must never see a row of an uncommitted checkpoint."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.workers import WorkerProcess, fault_hits

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.postgres, pytest.mark.slow]

PARTITIONS = 4
CUSTOMERS = 1000


def _max_committed_checkpoint(bootstrap: str, group: str, topic: str) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        committed = consumer.committed([TopicPartition(topic, p) for p in range(PARTITIONS)], 10)
    finally:
        consumer.close()
    ids = [int(c.metadata.split(":")[2]) for c in committed if c.metadata]
    return max(ids, default=0)


class TableReader(threading.Thread):
    """Reads the table with Spark in a loop; records every violation it sees."""

    def __init__(self, spark: Any, table: Path, bootstrap: str, group: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.spark, self.table = spark, table
        self.bootstrap, self.group, self.topic = bootstrap, group, topic
        self.stop_flag = threading.Event()
        self.reads = 0
        self.violations: list[str] = []

    def run(self) -> None:
        while not self.stop_flag.is_set():
            if not any(self.table.glob("*.parquet")):
                time.sleep(0.5)
                continue
            try:
                rows = (
                    self.spark.read.parquet(str(self.table))
                    .select("order_id", "checkpoint")
                    .collect()
                )
            except Exception as exc:  # a read must never fail on a live table
                self.violations.append(f"read failed: {exc!r:.300}")
                continue
            committed = _max_committed_checkpoint(self.bootstrap, self.group, self.topic)
            self.reads += 1
            dupes = [i for i, n in Counter(r.order_id for r in rows).items() if n > 1]
            if dupes:
                self.violations.append(f"read {self.reads}: duplicate orders {dupes[:5]}")
            newer = [r.checkpoint for r in rows if r.checkpoint > committed]
            if newer:
                self.violations.append(
                    f"read {self.reads}: rows of checkpoints {sorted(set(newer))[:5]} after "
                    f"committed {committed}"
                )
            time.sleep(0.2)


def test_kafka_parquet_postgres_exactly_once_under_sigkills(
    kafka_bootstrap: str, spark: Any, postgres_dsn: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    table_name = unique_name.replace("-", "_").lower()
    warehouse = tmp_path / "warehouse" / "customer_totals"
    create_topics(
        kafka_bootstrap, {f"{prefix}orders": PARTITIONS, f"{prefix}customer-totals": PARTITIONS}
    )
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table_name} (customer text PRIMARY KEY, total bigint, count bigint)"
        )
    env = {
        "SNAPLINE_EXAMPLE_PREFIX": prefix,
        "SNAPLINE_EXAMPLE_JOB": unique_name,
        "SNAPLINE_EXAMPLE_INTERVAL": "0.5",
        "SNAPLINE_WAREHOUSE": str(warehouse),
        "SNAPLINE_POSTGRES_DSN": postgres_dsn,
        "SNAPLINE_POSTGRES_TABLE": table_name,
    }
    workers = [
        WorkerProcess(
            "examples.warehouse:pipeline",
            f"w{i}",
            kafka_bootstrap,
            tmp_path / "checkpoints",
            tmp_path,
            env,
        )
        for i in range(2)
    ]
    fault_log = workers[0].fault_log

    def fault() -> dict[str, str]:
        hits = fault_hits(fault_log).get("after_kafka_commit", 0)
        return {"SNAPLINE_FAULT": "after_kafka_commit:0.15" if hits < 3 else ""}

    reader = TableReader(spark, warehouse, kafka_bootstrap, unique_name, f"{prefix}orders")
    expected: dict[str, int] = {}
    produced = 0
    for worker in workers:
        worker.start(fault())
    reader.start()
    rng = random.Random(5)
    kills = 0

    def produce(n: int) -> None:
        nonlocal produced
        for customer, amount in produce_orders(
            kafka_bootstrap, f"{prefix}orders", n, CUSTOMERS, start_id=produced
        ).items():
            expected[customer] = expected.get(customer, 0) + amount
        produced += n

    def restart_dead() -> None:
        for worker in workers:  # restart the ones a kill point took down
            if not worker.alive:
                worker.start(fault())

    try:
        # phase 1: 100k orders while a random worker is SIGKILLed at random moments
        while kills < 20 or produced < 100_000:
            if produced < 100_000:
                produce(5000)
            time.sleep(rng.uniform(0.3, 1.5))
            restart_dead()
            if kills < 20:
                victim = rng.choice(workers)
                victim.kill()
                kills += 1
                victim.start(fault())
        # phase 2: keep checkpoints coming (an idle pipeline writes none) until the kill
        # point after the Kafka commit has been hit 3 times; on a slow machine the random
        # kills above leave few commits for it to hit
        deadline = time.monotonic() + 420
        while fault_hits(fault_log).get("after_kafka_commit", 0) < 3:
            assert time.monotonic() < deadline, (
                f"kill point after_kafka_commit hit {fault_hits(fault_log)} times in 420 s"
            )
            produce(500)
            time.sleep(0.5)
            restart_dead()
        for worker in workers:
            if worker.alive:
                worker.kill()
            worker.start({"SNAPLINE_FAULT": ""})
        outputs = read_committed(
            kafka_bootstrap, f"{prefix}customer-totals", produced, timeout=240, settle=3
        )
        kafka_check = verify_totals(outputs, expected, range(produced))
        assert kafka_check.ok, "Kafka: " + kafka_check.summary()
        time.sleep(3)  # sinks commit right after the Kafka commit point
    finally:
        reader.stop_flag.set()
        reader.join(60)
        for worker in workers:
            worker.stop()

    # Spark on the table: per customer, counts 1..n once each and the final total
    rows = (
        spark.read.parquet(str(warehouse))
        .select("customer", "total", "count", "order_id")
        .collect()
    )
    assert len(rows) == produced, f"table has {len(rows)} rows for {produced} inputs"
    assert len({r.order_id for r in rows}) == produced
    final: dict[str, tuple[int, int]] = {}
    for r in rows:
        if r.customer not in final or r["count"] > final[r.customer][0]:
            final[r.customer] = (r["count"], r.total)
    assert {c: t for c, (_, t) in final.items()} == expected

    # SQL on the database: one row per customer with the final total and count
    with psycopg.connect(postgres_dsn) as conn:
        db = {
            c: (t, n)
            for c, t, n in conn.execute(
                f"SELECT customer, total, count FROM {table_name}"
            ).fetchall()
        }
    counts = Counter(o["customer"] for o in outputs)
    assert db == {c: (expected[c], counts[c]) for c in expected}

    assert kills >= 20
    assert fault_hits(fault_log).get("after_kafka_commit", 0) >= 3
    assert reader.reads >= 3, "the concurrent Spark reader barely ran"
    assert not reader.violations, reader.violations[:10]
