"""Stages on real workers and a real broker: pipelines that re-key through repartition topics
(2 and 3 stages), SIGKILLed at random and at every kill point, including the one between
producing to the repartition topic and the commit. Independent readers check every sink
(read_committed consumer, pyarrow on the table, SQL) and the repartition topics themselves:
a read_committed reader sees each order exactly once there too, so no aborted epoch leaked.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from examples.workers import fault_hits, read_events
from integration_tests.warehouse_job import WarehouseJob, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.slow]

KILL_POINTS = {
    "sync_snapshot": 0.05,
    "mid_materialization": 0.05,
    "after_metadata_write": 0.08,
    "after_kafka_commit": 0.08,
    "after_repartition_produce": 0.08,
}


def repartition_topic(job: WarehouseJob, name: str) -> str:
    return f"{job.name}.{name}.repartition"


def read_order_ids(bootstrap: str, topic: str, timeout: float = 60) -> Counter[int]:
    """Order ids of every committed record of ``topic`` (read_committed, from offset 0)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"verify-{time.time_ns()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    try:
        partitions = list(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in partitions
        }
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        ids: Counter[int] = Counter()
        done: set[int] = {p for p, end in ends.items() if end == 0}
        deadline = time.monotonic() + timeout
        while len(done) < len(partitions) and time.monotonic() < deadline:
            for msg in consumer.consume(5000, 0.5):
                if msg.error() is not None:
                    continue
                if (msg.key() or b"")[:1] == b"w":  # a watermark record (docs/time.md)
                    if msg.offset() >= ends[msg.partition()] - 2:
                        done.add(msg.partition())
                    continue
                ids[orjson.loads(msg.value())["order_id"]] += 1
                if msg.offset() >= ends[msg.partition()] - 2:  # the last record (or marker)
                    done.add(msg.partition())
            for p in partitions:  # a partition whose tail is only control records
                position = consumer.position([TopicPartition(topic, p)])[0].offset
                if position >= ends[p] - 1:
                    done.add(p)
        return ids
    finally:
        consumer.close()


def assert_each_order_once(job: WarehouseJob, topic: str) -> None:
    ids = read_order_ids(job.bootstrap, topic)
    dupes = sorted(i for i, n in ids.items() if n > 1)
    missing = sorted(set(range(job.produced)) - set(ids))
    assert not dupes and not missing, (
        f"{topic}: {len(dupes)} orders twice (e.g. {dupes[:5]}), {len(missing)} missing "
        f"(e.g. {missing[:5]})"
    )


def run_under_kills(job: WarehouseJob, orders: int, random_kills: int) -> dict[str, int]:
    """Input flows while workers are killed at the kill points (each ≥ 3 times) and at
    random moments (``random_kills``); then every worker runs without faults to the end."""
    fault_log = job.workers[0].fault_log

    def spec() -> str:
        hits = fault_hits(fault_log)
        return ",".join(f"{p}:{o}" for p, o in KILL_POINTS.items() if hits.get(p, 0) < 3)

    for worker in job.workers:
        worker.start({"SNAPLINE_FAULT": spec()})
    stop_producing = threading.Event()

    def produce() -> None:
        while not stop_producing.is_set():
            # a trickle after `orders`: an idle pipeline takes no checkpoints, so the kill
            # points could not be hit any more
            job.produce(2_000 if job.produced < orders else 200)
            time.sleep(0.3)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    rng = random.Random(11)
    kills = 0
    deadline = time.monotonic() + 420
    try:
        while (spec() or kills < random_kills or job.produced < orders) and (
            time.monotonic() < deadline
        ):
            time.sleep(rng.uniform(0.5, 2.0))
            if kills < random_kills:
                victim = rng.choice(job.workers)
                victim.kill()
                kills += 1
                time.sleep(rng.uniform(0.0, 0.5))
            for worker in job.workers:
                if not worker.alive:
                    worker.start({"SNAPLINE_FAULT": spec()})
    finally:
        stop_producing.set()
        producer.join()
    hits = fault_hits(fault_log)
    assert all(hits.get(p, 0) >= 3 for p in KILL_POINTS), f"kill points hit: {hits}\n{job.logs()}"
    assert kills >= random_kills
    for worker in job.workers:  # finish without faults
        if worker.alive:
            worker.kill()
        worker.start({"SNAPLINE_FAULT": ""})
    return hits


# CI runs the 3-stage pipeline (its two repartitions include the 2-stage one's by-customer);
# the 2-stage one with twice the orders runs with ``bash scripts/test -m long``.
@pytest.mark.parametrize("stages", [pytest.param(2, marks=pytest.mark.long), 3])
def test_rekeyed_pipeline_is_exactly_once_under_kills(
    kafka_bootstrap: str,
    postgres_dsn: str,
    tmp_path: Path,
    unique_name: str,
    jobs: list[Any],
    stages: int,
) -> None:
    """Orders keyed by order id, re-keyed by customer (and, with 3 stages, by order-id bucket
    first), 2 workers, ≥ 20 random SIGKILLs (2 stages) plus every kill point ≥ 3 times."""
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=4,
        interval=0.3,
        keyed_by_order=True,
        extra_env={
            "SNAPLINE_EXAMPLE_STAGES": str(stages),
            # every repartition record stays readable for the check below
            "SNAPLINE_TEST_KEEP_REPARTITION_RECORDS": "1",
        },
    )
    jobs.append(job)
    hits = run_under_kills(job, 60_000 if stages == 2 else 30_000, 20)
    job.verify()
    names = ["by-customer"] if stages == 2 else ["by-bucket", "by-customer"]
    for name in names:
        assert_each_order_once(job, repartition_topic(job, name))
    job.stop_all()
    print(f"\n{stages} stages: {job.produced} orders, kill points hit {hits}")


def test_keyed_stage_runs_with_more_partitions_than_its_source_on_every_worker(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """Source 2 partitions → repartition topic 8 partitions, 3 workers: every worker runs
    keyed tasks, the output is exactly once, and consumed repartition records are deleted."""
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=2,
        workers=3,
        interval=0.3,
        keyed_by_order=True,
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2", "SNAPLINE_EXAMPLE_PARTITIONS": "8"},
    )
    jobs.append(job)
    for worker in job.workers:
        worker.start()
    for _ in range(10):
        job.produce(3_000)
        time.sleep(0.5)
    job.verify()
    topic = repartition_topic(job, "by-customer")
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"v-{unique_name}"})

    def deleted() -> bool:
        lows = [
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[0]
            for p in range(8)
        ]
        return all(low > 0 for low in lows)

    try:
        assert len(consumer.list_topics(topic, timeout=10).topics[topic].partitions) == 8
        # Deletion needs 3 committed checkpoints past the records: keep a trickle of input.
        deadline = time.monotonic() + 60
        while not deleted() and time.monotonic() < deadline:
            job.produce(200)
            time.sleep(1)
        wait_for("consumed repartition records deleted", deleted, 5, job.logs)
    finally:
        consumer.close()
    job.stop_all()
    tasks: dict[str, set[str]] = {}
    for event in read_events(job.workers[0].metrics_path):
        if event.get("event") == "restored":
            tasks.setdefault(event["worker"], set()).update(event["checkpoints"])
    keyed = {w: {t for t in ts if t.startswith("s1-")} for w, ts in tasks.items()}
    assert len(keyed) == 3 and all(keyed.values()), f"keyed tasks per worker: {keyed}"
