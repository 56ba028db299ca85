"""One job of the warehouse example (Kafka + Parquet + PostgreSQL sinks) for integration
tests: its topics, table, checkpoint directory and worker processes, and a check of every sink
with an independent reader (read_committed consumer, pyarrow on the table, SQL).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.dataset as ds
from confluent_kafka import (
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.workers import WorkerProcess, child_pythonpath, process_state, read_events
from snapline.pipeline.checkpoint.metadata import decode_checked

SPEC = "examples.warehouse:pipeline"


def wait_for(
    what: str, condition: Callable[[], Any], timeout: float, logs: Callable[[], str] = str
) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s\n{logs()}"
        time.sleep(0.3)


def wait_frozen(
    worker: WorkerProcess, what: str, timeout: float, logs: Callable[[], str] = str
) -> None:
    """Until ``worker``'s process is stopped (SIGSTOP at a fault point: state T), ``timeout``
    s at most (its start and the way to the point)."""
    assert worker.proc is not None, f"{what}: the worker was not started"
    proc = worker.proc
    wait_for(what, lambda: process_state(proc.pid) == "T", timeout, logs)


def _committed(consumer: Consumer, topic: str, partitions: int) -> list[TopicPartition]:
    """The group's committed offsets, retried while the group coordinator is not ready."""
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    deadline = time.monotonic() + 60
    while True:
        try:
            return list(consumer.committed(tps, 20))
        except KafkaException:  # coordinator loading or moving
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class WarehouseJob:
    """Orders in, running totals out to a topic, a Parquet table and a PostgreSQL table."""

    def __init__(
        self,
        bootstrap: str,
        name: str,
        workdir: Path,
        postgres_dsn: str,
        *,
        partitions: int = 2,
        customers: int = 500,
        workers: int = 2,
        interval: float = 0.5,
        backend: str = "memory",
        retained: int = 3,
        tolerable: int = 3,
        extra_env: dict[str, str] | None = None,
        keyed_by_order: bool = False,
    ) -> None:
        self.bootstrap = bootstrap
        #: Orders keyed by order id in Kafka (a per-customer pipeline must re-key them).
        self.keyed_by_order = keyed_by_order
        self.name = name
        self.prefix = f"{name}-"
        self.partitions = partitions
        self.customers = customers
        self.workdir = workdir
        self.table = workdir / "warehouse" / "customer_totals"
        self.checkpoint_dir = workdir / "checkpoints"
        self.pg_table = name.replace("-", "_").lower()
        self.dsn = postgres_dsn
        self.orders_topic = f"{self.prefix}orders"
        self.totals_topic = f"{self.prefix}customer-totals"
        workdir.mkdir(parents=True, exist_ok=True)
        self.create_topics(bootstrap)
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE {self.pg_table} "
                "(customer text PRIMARY KEY, total bigint, count bigint)"
            )
        self.env = {
            "SNAPLINE_EXAMPLE_PREFIX": self.prefix,
            "SNAPLINE_EXAMPLE_JOB": name,
            "SNAPLINE_EXAMPLE_INTERVAL": str(interval),
            "SNAPLINE_EXAMPLE_BACKEND": backend,
            "SNAPLINE_EXAMPLE_RETAINED": str(retained),
            "SNAPLINE_EXAMPLE_TOLERABLE": str(tolerable),
            **(extra_env or {}),
            "SNAPLINE_WAREHOUSE": str(self.table),
            "SNAPLINE_POSTGRES_DSN": postgres_dsn,
            "SNAPLINE_POSTGRES_TABLE": self.pg_table,
        }
        self.workers = [self.worker(f"w{i}") for i in range(workers)]
        self.expected: dict[str, int] = {}
        self.produced = 0

    def create_topics(self, bootstrap: str) -> None:
        create_topics(
            bootstrap, {self.orders_topic: self.partitions, self.totals_topic: self.partitions}
        )

    def worker(self, worker_id: str, bootstrap: str | None = None) -> WorkerProcess:
        return WorkerProcess(
            SPEC,
            worker_id,
            bootstrap or self.bootstrap,
            self.checkpoint_dir,
            self.workdir,
            self.env,
        )

    def produce(self, count: int) -> None:
        totals = produce_orders(
            self.bootstrap,
            self.orders_topic,
            count,
            self.customers,
            start_id=self.produced,
            keyed_by_order=self.keyed_by_order,
        )
        for customer, amount in totals.items():
            self.expected[customer] = self.expected.get(customer, 0) + amount
        self.produced += count

    def committed_checkpoints(self) -> dict[int, int | None]:
        """Partition -> the checkpoint id its committed offset names (None: no commit)."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.name})
        try:
            committed = _committed(consumer, self.orders_topic, self.partitions)
        finally:
            consumer.close()
        return {
            c.partition: int(c.metadata.split(":")[2]) if c.metadata else None for c in committed
        }

    def wait_until_caught_up(self, timeout: float = 180) -> None:
        """Until committed offsets cover every produced order (AssertionError after timeout)."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.name})
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    committed = _committed(consumer, self.orders_topic, self.partitions)
                except KafkaException as exc:
                    raise AssertionError(
                        f"the group's committed offsets stayed unreadable ({exc}); what the "
                        f"broker answers:\n{self.offset_fetch_report()}\n{self.logs()}"
                    ) from exc
                ends = [
                    consumer.get_watermark_offsets(TopicPartition(c.topic, c.partition), 10)[1]
                    for c in committed
                ]
                if all(c.offset >= e for c, e in zip(committed, ends, strict=True)):
                    return
                time.sleep(0.5)
        finally:
            consumer.close()
        raise AssertionError(f"workers did not catch up in {timeout} s\n{self.logs()}")

    def offset_fetch_report(self) -> str:
        """The group's offsets of the input topic fetched as stable and as last committed: a
        partition that answers UNSTABLE_OFFSET_COMMIT to the first and an offset to the second
        has a transactional offset commit pending, which only its transaction's commit or
        abort clears (Kafka's "hanging transaction" when neither ever comes)."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        partitions = [TopicPartition(self.orders_topic, p) for p in range(self.partitions)]
        lines = []
        for stable in (True, False):
            request = [ConsumerGroupTopicPartitions(self.name, partitions)]
            for _attempt in range(5):  # a coordinator may still be loading: bounded retries
                try:
                    futures = admin.list_consumer_group_offsets(
                        request, require_stable=stable, request_timeout=20
                    )
                    (result,) = [f.result(timeout=30) for f in futures.values()]
                    answers = ", ".join(
                        f"{tp.partition}: {tp.error.name() if tp.error else tp.offset}"
                        for tp in result.topic_partitions
                    )
                    break
                except Exception as exc:
                    answers = repr(exc)
                    time.sleep(2)
            lines.append(f"require_stable={stable}: {answers}")
        return "\n".join(lines)

    def table_rows(self) -> list[dict[str, Any]]:
        if not self.table.exists():
            return []
        dataset = ds.dataset(self.table, format="parquet", partitioning="hive")
        if not dataset.files:  # the directory exists, no file published yet: no schema
            return []
        return dataset.to_table(columns=["customer", "total", "count", "order_id"]).to_pylist()

    def table_rows_with_checkpoint(self) -> list[dict[str, Any]]:
        if not self.table.exists():
            return []
        dataset = ds.dataset(self.table, format="parquet", partitioning="hive")
        if not dataset.files:
            return []
        return dataset.to_table(
            columns=["customer", "total", "count", "order_id", "checkpoint"]
        ).to_pylist()

    def database(self) -> dict[str, tuple[int, int]]:
        """customer -> (total, count) in the PostgreSQL table."""
        with psycopg.connect(self.dsn) as conn:
            return {
                c: (t, n)
                for c, t, n in conn.execute(
                    f"SELECT customer, total, count FROM {self.pg_table}"
                ).fetchall()
            }

    def verify(self) -> None:
        """Every order's effect exactly once in Kafka, the Parquet table and PostgreSQL."""
        outputs = read_committed(
            self.bootstrap, self.totals_topic, self.produced, timeout=180, settle=3.0
        )
        kafka = verify_totals(outputs, self.expected, range(self.produced))
        assert kafka.ok, "Kafka: " + kafka.summary() + "\n" + self.logs()
        self.verify_table_and_database()

    def verify_table_and_database(self) -> None:
        """Every order's effect exactly once in the Parquet table and in PostgreSQL."""
        deadline = time.monotonic() + 30  # sinks publish right after the Kafka commit point
        while len(self.table_rows()) < self.produced and time.monotonic() < deadline:
            time.sleep(0.5)
        rows = self.table_rows()
        ids = Counter(r["order_id"] for r in rows)
        assert len(rows) == self.produced and set(ids) == set(range(self.produced)), (
            f"Parquet: {len(rows)} rows for {self.produced} orders, "
            f"{sum(1 for n in ids.values() if n > 1)} duplicated, "
            f"{self.produced - len(set(ids) & set(range(self.produced)))} missing\n" + self.logs()
        )
        final: dict[str, tuple[int, int]] = {}
        for r in rows:
            if r["customer"] not in final or r["count"] > final[r["customer"]][0]:
                final[r["customer"]] = (r["count"], r["total"])
        assert {c: t for c, (_, t) in final.items()} == self.expected, "Parquet totals"
        with psycopg.connect(self.dsn) as conn:
            db = {
                c: (t, n)
                for c, t, n in conn.execute(
                    f"SELECT customer, total, count FROM {self.pg_table}"
                ).fetchall()
            }
        counts = Counter(r["customer"] for r in rows)  # one row per order (checked above)
        assert db == {c: (self.expected[c], counts[c]) for c in self.expected}, "PostgreSQL"

    def logs(self) -> str:
        return "\n".join(f"--- {w.worker_id}\n{w.tail()}" for w in self.workers)

    def stop_all(self) -> None:
        for worker in self.workers:
            if worker.alive:
                worker.stop()


def cli_env(job: WarehouseJob, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the snapline CLI runs with for the job."""
    return {
        **os.environ,
        **job.env,
        **(env or {}),
        "PYTHONPATH": child_pythonpath(),
        "SNAPLINE_BOOTSTRAP_SERVERS": job.bootstrap,
        "SNAPLINE_CHECKPOINT_DIR": str(job.checkpoint_dir),
    }


def snapline(job: WarehouseJob, *args: str, env: dict[str, str] | None = None) -> str:
    """Run the snapline CLI for the job; its stdout (the savepoint path for create)."""
    result = subprocess.run(
        [sys.executable, "-m", "snapline.pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=job.workdir,
        env=cli_env(job, env),
    )
    assert result.returncode == 0, f"snapline {args}: {result.stderr}\n{job.logs()}"
    (job.workdir / "cli-stderr.log").write_text(result.stderr)  # the last command's, for checks
    return result.stdout.strip().splitlines()[-1]


def start_from_savepoint(job: WarehouseJob, path: str, partitions: int) -> None:
    """The first worker seeds the job from the savepoint; the others join once it runs."""
    job.env["SNAPLINE_EXAMPLE_PARTITIONS"] = str(partitions)
    for worker in job.workers:
        worker.env["SNAPLINE_EXAMPLE_PARTITIONS"] = str(partitions)
    first, *others = job.workers
    first.start(extra_args=["--from-savepoint", path])
    marker = job.checkpoint_dir / job.name / "restored-from-savepoint.json"
    wait_for(
        "the job seeded from the savepoint",
        lambda: (
            marker.exists() and decode_checked(marker.read_bytes(), "marker")["savepoint"] == path
        ),
        120,
        job.logs,
    )
    for worker in others:
        worker.start(extra_args=["--from-savepoint", path])


def wait_running(job: WarehouseJob) -> None:
    """Until every worker has restored its assignment (a member with its tasks; it may be idle:
    an idle worker commits no checkpoint, so that cannot be the condition)."""

    def running() -> bool:
        events = read_events(job.workers[0].metrics_path)
        done = {e["worker"] for e in events if e.get("event") == "restored"}
        return done >= {w.worker_id for w in job.workers}

    wait_for("every worker running", running, 120, job.logs)


def kill_randomly(job: WarehouseJob, kills: int, rng: random.Random, orders: int) -> None:
    for i in range(kills):
        job.produce(orders // kills)
        time.sleep(rng.uniform(0.3, 1.5))
        victim = rng.choice(job.workers)
        victim.kill()
        time.sleep(rng.uniform(0.0, 0.4))
        victim.start()
        if i == kills - 1:
            time.sleep(1)
