"""Event-time windows on real workers and a real broker (examples/windows.py): orders re-keyed
by customer through a repartition topic, then a tumbling aggregate and a session count.

- 2 workers, ≥ 20 random SIGKILLs plus every kill point: a read_committed reader sees every
  window result exactly once with the value a reference computes from the produced orders
  (pyarrow on the Parquet table and SQL on PostgreSQL: every per-minute row exactly once),
  and no record was late (the watermark crossing the repartition topic is the minimum over
  both upstream tasks: a wrong one would make records late or windows fire early).
- a source partition that stays quiet does not stall the windows past its idle timeout.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pyarrow.dataset as ds
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from examples.orders import create_topics
from examples.workers import WorkerProcess, fault_hits
from snapline.pipeline.savepoint import control

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPEC = "examples.windows:pipeline"
WINDOW_MS = 1_000
GAP_MS = 700
OUT_OF_ORDERNESS_MS = 1_500
KILL_POINTS = {
    "sync_snapshot": 0.05,
    "mid_materialization": 0.05,
    "after_metadata_write": 0.08,
    "after_kafka_commit": 0.08,
    "after_repartition_produce": 0.08,
}
Window = tuple[str, int, int]


class WindowJob:
    """Topics, workers and input of one run of the windows example."""

    def __init__(
        self,
        bootstrap: str,
        name: str,
        workdir: Path,
        *,
        workers: int = 2,
        idle: float = 30,
        postgres_dsn: str | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.name = name
        self.prefix = f"{name}-"
        self.orders = f"{self.prefix}orders"
        self.per_minute = f"{self.prefix}orders-per-minute"
        self.sessions = f"{self.prefix}sessions"
        create_topics(bootstrap, {self.orders: 2, self.per_minute: 2, self.sessions: 2})
        env = {
            "SNAPLINE_EXAMPLE_PREFIX": self.prefix,
            "SNAPLINE_EXAMPLE_JOB": name,
            "SNAPLINE_EXAMPLE_INTERVAL": "0.3",
            "SNAPLINE_WINDOW_MS": str(WINDOW_MS),
            "SNAPLINE_SESSION_GAP_MS": str(GAP_MS),
            "SNAPLINE_OUT_OF_ORDERNESS_MS": str(OUT_OF_ORDERNESS_MS),
            "SNAPLINE_IDLE_TIMEOUT": str(idle),
        }
        self.table = workdir / "warehouse" / "orders_per_minute"
        self.pg_table = name.replace("-", "_").lower()
        self.dsn = postgres_dsn
        if postgres_dsn:
            env["SNAPLINE_WAREHOUSE"] = str(self.table)
            env["SNAPLINE_POSTGRES_DSN"] = postgres_dsn
            env["SNAPLINE_POSTGRES_TABLE"] = self.pg_table
            with psycopg.connect(postgres_dsn, autocommit=True) as conn:
                conn.execute(
                    f"CREATE TABLE {self.pg_table} (customer text, window_start bigint, "
                    "window_end bigint, orders bigint, amount bigint, "
                    "PRIMARY KEY (customer, window_start))"
                )
        self.workers = [
            WorkerProcess(SPEC, f"w{i}", bootstrap, workdir / "checkpoints", workdir, env)
            for i in range(workers)
        ]
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
        self.rng = random.Random(5)
        self.events: list[dict[str, Any]] = []
        self.base = 1_700_000_000_000
        self.clock = self.base

    def produce(self, count: int, partition: int | None = None) -> None:
        """Orders with event times 2-4 ms apart, each up to 1 s early (less than the
        out-of-orderness bound, so none is late); customers shop in bursts, so sessions end."""
        for _ in range(count):
            self.clock += self.rng.randint(2, 4)
            block = (self.clock - self.base) // 1_500
            customer = f"c{(block * 7 + self.rng.randrange(4)) % 12}"
            event = {
                "order_id": len(self.events),
                "customer": customer,
                "amount": self.rng.randint(1, 50),
                "ts": self.clock - self.rng.randint(0, 1_000),
            }
            self.events.append(event)
            target = {} if partition is None else {"partition": partition}
            self.producer.produce(
                self.orders, orjson.dumps(event), str(event["order_id"]).encode(), **target
            )
        self.producer.flush(30)

    def flush_windows(self) -> None:
        """One far-future order per partition: the watermark passes every real window."""
        for partition in (0, 1):
            event = {"order_id": -1, "customer": "~end", "amount": 0, "ts": self.clock + 60_000}
            self.producer.produce(self.orders, orjson.dumps(event), b"end", partition=partition)
        self.producer.flush(30)

    def table_windows(self) -> list[Window]:
        """(customer, start, end) of every row of the Parquet table, duplicates included."""
        if not self.table.exists():
            return []
        rows = ds.dataset(self.table, format="parquet").to_table().to_pylist()
        return [(r["customer"], r["window_start"], r["window_end"]) for r in rows]

    def database_windows(self) -> dict[Window, Any]:
        assert self.dsn is not None
        with psycopg.connect(self.dsn) as conn:
            rows = conn.execute(
                f"SELECT customer, window_start, window_end, orders, amount FROM {self.pg_table}"
            ).fetchall()
        return {(c, s, e): {"orders": n, "amount": a} for c, s, e, n, a in rows}

    def logs(self) -> str:
        return "\n".join(f"--- {w.worker_id}\n{w.tail(60)}" for w in self.workers)


def expected_windows(events: list[dict[str, Any]]) -> tuple[dict[Window, Any], dict[Window, Any]]:
    tumbling: dict[Window, Any] = {}
    by_customer: dict[str, list[int]] = {}
    for e in events:
        start = e["ts"] - e["ts"] % WINDOW_MS
        stats = tumbling.setdefault(
            (e["customer"], start, start + WINDOW_MS), {"orders": 0, "amount": 0}
        )
        stats["orders"] += 1
        stats["amount"] += e["amount"]
        by_customer.setdefault(e["customer"], []).append(e["ts"])
    sessions: dict[Window, Any] = {}
    for customer, stamps in by_customer.items():
        stamps.sort()
        first, end, count = stamps[0], stamps[0] + GAP_MS, 0
        for ts in stamps:
            if ts > end:  # a gap longer than GAP_MS: the session closed
                sessions[(customer, first, end)] = count
                first, count = ts, 0
            end = max(end, ts + GAP_MS)
            count += 1
        sessions[(customer, first, end)] = count
    return tumbling, sessions


def read_results(bootstrap: str, topic: str, until: float) -> list[dict[str, Any]]:
    """Every committed record of ``topic`` so far (read_committed, from offset 0)."""
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
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        values = []
        quiet = 0
        while time.monotonic() < until and quiet < 3:
            batch = consumer.consume(5000, 0.5)
            quiet = 0 if batch else quiet + 1
            values += [orjson.loads(m.value()) for m in batch if m.error() is None]
        return values
    finally:
        consumer.close()


def results_by_window(values: list[dict[str, Any]]) -> tuple[dict[Window, Any], list[Window]]:
    counts = Counter((v["key"], v["start"], v["end"]) for v in values)
    twice = [w for w, n in counts.items() if n > 1]
    return {(v["key"], v["start"], v["end"]): v["value"] for v in values}, twice


def wait_for_windows(
    job: WindowJob, topic: str, expected: dict[Window, Any], timeout: float
) -> dict[Window, Any]:
    deadline = time.monotonic() + timeout
    while True:
        # At least a few seconds of reading: the last read after the deadline is not empty.
        until = max(deadline, time.monotonic() + 5)
        got, twice = results_by_window(read_results(job.bootstrap, topic, until))
        assert not twice, f"{topic}: windows emitted twice: {twice[:5]}"
        got = {w: v for w, v in got.items() if w[0] != "~end"}
        if set(got) >= set(expected) or time.monotonic() > deadline:
            return got
        time.sleep(1)


@pytest.mark.postgres
def test_windows_are_exactly_once_under_kills(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str
) -> None:
    job = WindowJob(kafka_bootstrap, unique_name, tmp_path, postgres_dsn=postgres_dsn)
    fault_log = job.workers[0].fault_log

    def spec() -> str:
        hits = fault_hits(fault_log)
        return ",".join(f"{p}:{o}" for p, o in KILL_POINTS.items() if hits.get(p, 0) < 2)

    try:
        for worker in job.workers:
            worker.start({"SNAPLINE_FAULT": spec()})
        stop = threading.Event()

        def produce() -> None:
            while not stop.is_set():
                job.produce(300)
                time.sleep(0.2)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        rng = random.Random(3)
        kills = 0
        deadline = time.monotonic() + 150
        try:
            while (spec() or kills < 20) and time.monotonic() < deadline:
                time.sleep(rng.uniform(0.4, 1.5))
                if kills < 20:
                    rng.choice(job.workers).kill()
                    kills += 1
                for worker in job.workers:
                    if not worker.alive:
                        worker.start({"SNAPLINE_FAULT": spec()})
        finally:
            stop.set()
            producer.join(30)
        hits = fault_hits(fault_log)
        assert kills >= 20 and not spec(), f"kills {kills}, kill points hit {hits}\n{job.logs()}"
        for worker in job.workers:  # finish without faults
            worker.kill()
            worker.start({"SNAPLINE_FAULT": ""})
        job.flush_windows()
        tumbling, sessions = expected_windows(job.events)
        got = wait_for_windows(job, job.per_minute, tumbling, 90)
        assert got == tumbling, f"tumbling: {len(got)} of {len(tumbling)} windows\n{job.logs()}"
        got = wait_for_windows(job, job.sessions, sessions, 30)
        assert got == sessions, f"sessions: {len(got)} of {len(sessions)} windows\n{job.logs()}"
        # The same windows in the Parquet table (each row once) and in PostgreSQL.
        real = {w for w in tumbling}
        deadline = time.monotonic() + 30
        while set(job.table_windows()) < real and time.monotonic() < deadline:
            time.sleep(0.5)
        table = Counter(w for w in job.table_windows() if w[0] != "~end")
        assert set(table) == real and max(table.values()) == 1, (
            f"Parquet: {len(table)} of {len(real)} windows, "
            f"{sum(1 for n in table.values() if n > 1)} twice"
        )
        database = {w: v for w, v in job.database_windows().items() if w[0] != "~end"}
        assert database == tumbling, f"PostgreSQL: {len(database)} of {len(tumbling)} windows"
        late = read_results(kafka_bootstrap, f"{unique_name}.dead-letter", time.monotonic() + 5)
        assert not late, f"{len(late)} records were late: the watermark was wrong"
        print(
            f"\nwindows: {len(job.events)} orders, {len(tumbling)} tumbling and "
            f"{len(sessions)} session windows exactly once; {kills} kills, kill points {hits}"
        )
    finally:
        for worker in job.workers:
            worker.kill()


def test_a_quiet_partition_does_not_stall_the_windows(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Orders only in partition 0 of 2; partition 1's task (on the other worker) goes idle
    after 2 s and says so in its watermark records, so the window stage's watermark follows
    partition 0 alone."""
    job = WindowJob(kafka_bootstrap, unique_name, tmp_path, idle=2.0)
    try:
        for worker in job.workers:
            worker.start()
        job.produce(3_000, partition=0)
        watermark = max(e["ts"] for e in job.events) - OUT_OF_ORDERNESS_MS - 1
        tumbling, _ = expected_windows(job.events)
        closed = {w: v for w, v in tumbling.items() if w[2] - 1 <= watermark}
        assert len(closed) > 20
        produced_at = time.monotonic()
        got = wait_for_windows(job, job.per_minute, closed, 60)
        waited = time.monotonic() - produced_at
        assert got == closed, f"{len(got)} of {len(closed)} closed windows\n{job.logs()}"
        print(f"\nquiet partition: {len(closed)} windows out {waited:.1f} s after the input")
    finally:
        for worker in job.workers:
            worker.kill()


def test_a_backlog_waiting_through_a_savepoint_pause_is_not_late(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Partition 1 holds orders a minute ahead in event time and then goes quiet (idle after
    2 s: partition 0 alone holds the watermark back); partition 0 keeps receiving orders. A
    savepoint request pauses the worker for 3 idle timeouts while partition 0's backlog grows
    in Kafka. Partition 0 must not count as idle then: if it did, every input would be idle,
    the watermark would jump to partition 1's, the windows would fire without the backlog and
    its orders would be late. Every window must come out with every order, and none late."""
    job = WindowJob(kafka_bootstrap, unique_name, tmp_path, workers=1, idle=2.0)
    worker = job.workers[0]
    config = {"bootstrap.servers": kafka_bootstrap}
    lock = threading.Lock()

    def order(ts: int, partition: int, producer: Producer) -> None:
        with lock:
            event = {"order_id": len(job.events), "customer": f"c{len(job.events) % 4}"}
            event |= {"amount": 1 + len(job.events) % 7, "ts": ts}
            job.events.append(event)
        producer.produce(
            job.orders, orjson.dumps(event), str(event["order_id"]).encode(), partition=partition
        )

    stop = threading.Event()

    def trickle() -> None:  # partition 0: event time as fast as real time, from the base on
        producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
        ts = job.base
        while not stop.is_set():
            ts += 20
            order(ts, 0, producer)
            producer.poll(0)
            time.sleep(0.02)
        producer.flush(30)

    ahead = Producer({"bootstrap.servers": kafka_bootstrap})
    request = control.new_request_id()
    ack = tmp_path / "checkpoints" / unique_name / "savepoints" / "_requests" / request / "w0.json"
    try:
        worker.start()
        for i in range(100):
            order(job.base + 60_000 + 10 * i, 1, ahead)
        ahead.flush(30)
        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        try:
            # Partition 0's first window closes by its own watermark: the worker runs, and
            # partition 1 (idle) no longer holds it back.
            first = {w for w in expected_windows(job.events)[0] if w[2] <= job.base + 1_000}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the output never goes quiet: short reads
                got, _ = results_by_window(
                    read_results(kafka_bootstrap, job.per_minute, time.monotonic() + 1)
                )
                if set(got) >= first:
                    break
            assert set(got) >= first, f"no window of partition 0 came out\n{job.logs()}"
            control.send(config, unique_name, "savepoint", request)
            deadline = time.monotonic() + 60
            while not ack.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert ack.exists(), f"the worker did not acknowledge the savepoint\n{job.logs()}"
            assert orjson.loads(ack.read_bytes())["status"] == "paused"
            time.sleep(6.0)  # paused for 3 idle timeouts while partition 0's backlog grows
            control.send(config, unique_name, "resume", request)
            time.sleep(3.0)
        finally:
            stop.set()
            thread.join(30)
        job.clock = job.base + 120_000
        job.flush_windows()
        tumbling, _ = expected_windows(job.events)
        got = wait_for_windows(job, job.per_minute, tumbling, 60)
        wrong = {w: (got.get(w), v) for w, v in tumbling.items() if got.get(w) != v}
        assert not wrong, (
            f"{len(wrong)} of {len(tumbling)} windows wrong (got, expected), e.g. "
            f"{sorted(wrong.items())[:3]}\n{job.logs()}"
        )
        late = read_results(kafka_bootstrap, f"{unique_name}.dead-letter", time.monotonic() + 5)
        assert not late, f"{len(late)} orders were late: the watermark jumped past them"
        print(f"\nsavepoint pause: {len(job.events)} orders, {len(tumbling)} windows, none late")
    finally:
        worker.kill()
