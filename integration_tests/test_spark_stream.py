"""The same pipeline on Spark, continuous (issue 14): the warehouse running total as a
Structured Streaming query on real PySpark (local[2]) reading a real broker, into Kafka,
Parquet and PostgreSQL. Orders keep arriving while the driver process (with its JVM and Python
workers: the whole process group) is SIGKILLed, at random moments and right after a batch's
Kafka commit point, and restarted from its checkpoint location. Independent readers
(read_committed consumer, pyarrow, SQL) find every order exactly once and the per-customer
totals equal the ones computed by the producer. Beside the running total, the same keyed
stream feeds a rolling count (a branch): its outputs count each customer's orders 1..n, each
once; and before key_by every order goes to a raw sink, where each appears once.

Each kill test runs twice: with one kill (the default run and CI: right after a commit point
for the running total, at a random moment for the windows, so CI sees both kinds) and with 5
of both kinds (marked ``long``, left out by default: ``bash scripts/test -m long``). A kill
costs a driver start (a JVM and a Spark session, 15-30 s on 2 cores).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Producer

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.workers import child_pythonpath
from integration_tests.pipelines import LATE_ALLOWED_MS, LATE_WINDOW_MS
from integration_tests.warehouse_job import SPEC, WarehouseJob, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.postgres]

ORDERS_PER_ROUND = 400
#: The kills of a run, in order: ``random`` at a random moment, ``after-commit`` right after a
#: batch's Kafka commit point.
LONG = ("random", "after-commit", "random", "after-commit", "random")


def kills_of(short: tuple[str, ...]) -> Any:
    """The kill test's two runs: ``short`` by default, ``LONG`` under ``-m long``."""
    return pytest.mark.parametrize(
        "kills",
        [short, pytest.param(LONG, marks=pytest.mark.long)],
        ids=[f"{len(short)}-kill", f"{len(LONG)}-kills"],
    )


class StreamDriver:
    """``snapline spark stream`` as a subprocess in its own process group (driver, JVM and
    Spark's Python workers die together, like a crashed machine)."""

    def __init__(self, job: Any, location: Path, spec: str = SPEC) -> None:
        self.job = job  # a WarehouseJob or a WindowJob: env, workdir, bootstrap, checkpoint_dir
        self.location = location
        self.spec = spec
        self.log = job.workdir / "spark-stream.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self, kill_after_commit: bool = False) -> None:
        self.runs += 1
        inject = {"SNAPLINE_SPARK_STREAM_KILL_AFTER_COMMIT": "1"} if kill_after_commit else {}
        with self.log.open("ab") as out:
            out.write(f"\n===== run {self.runs}\n".encode())
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "snapline.pipeline.cli",
                    "spark",
                    "stream",
                    self.spec,
                    "--checkpoint-location",
                    str(self.location),
                    "--trigger",
                    "processing-time=1s",
                    "--master",
                    "local[2]",
                    "--state-partitions",
                    "2",
                ],
                cwd=self.job.workdir,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={
                    **os.environ,
                    **self.job.env,
                    "PYTHONPATH": child_pythonpath(),
                    "SNAPLINE_BOOTSTRAP_SERVERS": self.job.bootstrap,
                    "SNAPLINE_CHECKPOINT_DIR": str(self.job.checkpoint_dir),
                    **inject,
                },
            )

    def current_log(self) -> str:
        return self.log.read_text(errors="replace").rsplit("===== run ", 1)[-1]

    def wait_started(self, timeout: float) -> None:
        """Until the query runs (Spark's session starts in seconds; bounded by ``timeout``)."""

        def started() -> bool:
            assert self.process is not None and self.process.poll() is None, (
                f"the driver exited\n{self.tail()}"
            )
            return "query started" in self.current_log()

        wait_for("the query started", started, timeout, self.tail)

    def wait_self_kill(self, timeout: float) -> None:
        """Until the driver SIGKILLed itself after its first Kafka commit: input is pending,
        so its first batch commits once Spark is up."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no self-kill in {timeout} s\n{self.tail()}") from None
        assert code == -signal.SIGKILL, f"driver exit {code}\n{self.tail()}"
        assert "injected SIGKILL after the Kafka commit" in self.current_log(), self.tail()
        self.kill()  # the rest of its process group: the JVM and Spark's Python workers

    def kill(self) -> None:
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)  # SIGKILL cannot be ignored

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""


def kill_and_restart(
    driver: StreamDriver, produce: Any, rng: random.Random, kills: tuple[str, ...]
) -> None:
    """SIGKILLs while input flows, one per entry of ``kills``: at a random moment of a run,
    or right after a batch's Kafka commit point (before Parquet and PostgreSQL publish it and
    before Spark marks it done); then the last start."""
    for kind in kills:
        if kind == "after-commit":
            driver.start(kill_after_commit=True)
            produce()  # input flows while the query runs
            driver.wait_self_kill(150)
        else:
            driver.start()
            driver.wait_started(90)
            produce()
            time.sleep(rng.uniform(1.0, 10.0))  # mostly inside the first batch (15-30 s)
            driver.kill()
    driver.start()


@kills_of(("after-commit",))
def test_streaming_running_total_exactly_once_across_driver_sigkills(
    kafka_bootstrap: str,
    postgres_dsn: str,
    tmp_path: Path,
    unique_name: str,
    kills: tuple[str, ...],
) -> None:
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=2,
        customers=50,
        workers=0,
        # key_by() also feeds a rolling count; before it, every order goes to a raw sink
        extra_env={"SNAPLINE_EXAMPLE_COUNTS": "1", "SNAPLINE_EXAMPLE_RAW": "1"},
    )
    counts_topic = f"{job.prefix}order-counts"
    raw_topic = f"{job.prefix}orders-raw"
    create_topics(kafka_bootstrap, {counts_topic: 2, raw_topic: 2})
    driver = StreamDriver(job, tmp_path / "spark-checkpoint")
    job.logs = driver.tail  # type: ignore[method-assign]  # failure messages show the driver
    rng = random.Random(14)
    try:
        job.produce(ORDERS_PER_ROUND)
        kill_and_restart(driver, lambda: job.produce(ORDERS_PER_ROUND), rng, kills)
        job.produce(ORDERS_PER_ROUND)
        # Every order reaches the Parquet table within a few 1 s batches of a running driver.
        wait_for(
            "every order in the Parquet table",
            lambda: len(job.table_rows()) >= job.produced,
            120,
            driver.tail,
        )
        assert driver.runs == len(kills) + 1
        job.verify()  # Kafka, Parquet and PostgreSQL: each order once, totals as expected
        # The branch beside the running total: customer c's n orders counted 1..n, once each.
        orders = Counter(r["customer"] for r in job.table_rows())  # one row per order (verified)
        counts = read_committed(kafka_bootstrap, counts_topic, job.produced, settle=3.0)
        seen: dict[str, list[int]] = {}
        for out in counts:
            seen.setdefault(out["key"], []).append(out["value"])
        assert {c: sorted(v) for c, v in seen.items()} == {
            c: list(range(1, n + 1)) for c, n in orders.items()
        }, f"order counts: {len(counts)} outputs for {job.produced} orders\n{driver.tail()}"
        # The sink before key_by: every order once.
        raw_orders = read_committed(kafka_bootstrap, raw_topic, job.produced)
        raw = Counter(r["order_id"] for r in raw_orders)
        assert raw == Counter(range(job.produced)), (
            f"raw orders: {sum(raw.values())} outputs for {job.produced} orders\n{driver.tail()}"
        )
        # The batches committed to Kafka just before a kill were re-run by Spark and skipped.
        log = driver.log.read_text(errors="replace")
        assert log.count("committed before a restart") >= kills.count("after-commit"), driver.tail()
    finally:
        if driver.process is not None and driver.process.poll() is None:
            driver.kill()


WINDOW_SPEC = "examples.windows:pipeline"
WINDOW_MS = 10_000
CUSTOMERS = 20


class WindowJob:
    """examples.windows with its per-minute window only (SNAPLINE_EXAMPLE_SESSIONS=0): orders
    with increasing event times in, per customer and window the number and sum of orders out,
    to Kafka, a Parquet table and PostgreSQL."""

    def __init__(self, bootstrap: str, name: str, workdir: Path, dsn: str) -> None:
        import psycopg

        from examples.orders import create_topics

        self.bootstrap, self.workdir, self.dsn = bootstrap, workdir, dsn
        self.checkpoint_dir = workdir / "checkpoints"
        self.table = workdir / "warehouse" / "per_window"
        self.pg_table = name.replace("-", "_").lower()
        self.orders_topic, self.out_topic = f"{name}-orders", f"{name}-orders-per-minute"
        create_topics(bootstrap, {self.orders_topic: 2, self.out_topic: 2})
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE {self.pg_table} (customer text, window_start bigint, "
                "window_end bigint, orders bigint, amount bigint, "
                "PRIMARY KEY (customer, window_start))"
            )
        self.env = {
            "SNAPLINE_EXAMPLE_PREFIX": f"{name}-",
            "SNAPLINE_EXAMPLE_JOB": name,
            "SNAPLINE_EXAMPLE_SESSIONS": "0",
            "SNAPLINE_WINDOW_MS": str(WINDOW_MS),
            "SNAPLINE_OUT_OF_ORDERNESS_MS": "1000",
            "SNAPLINE_WAREHOUSE": str(self.table),
            "SNAPLINE_POSTGRES_DSN": dsn,
            "SNAPLINE_POSTGRES_TABLE": self.pg_table,
        }
        self.produced = 0
        #: (customer, window start) -> (orders, amount), computed here from what was produced
        self.expected: dict[tuple[str, int], tuple[int, int]] = {}

    def produce(self, count: int, *, flush: bool = False) -> None:
        """``count`` orders, 100 ms of event time apart, keyed by customer; ``flush``: one more
        order 10 windows later (of customer "flush") whose event time closes every window
        before it."""
        import orjson
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.bootstrap, "partitioner": "murmur2_random"})
        for i in range(self.produced, self.produced + count):
            customer, ts, amount = f"c{i % CUSTOMERS:02d}", 1_000_000 + i * 100, i % 7 + 1
            order = {"customer": customer, "amount": amount, "order_id": i, "ts": ts}
            producer.produce(self.orders_topic, orjson.dumps(order), customer.encode())
            window = (customer, ts - ts % WINDOW_MS)
            orders, total = self.expected.get(window, (0, 0))
            self.expected[window] = (orders + 1, total + amount)
        self.produced += count
        if flush:
            ts = 1_000_000 + self.produced * 100 + 10 * WINDOW_MS
            order = {"customer": "flush", "amount": 0, "order_id": -1, "ts": ts}
            producer.produce(self.orders_topic, orjson.dumps(order), b"flush")
        producer.flush(30)

    def table_rows(self) -> list[dict[str, Any]]:
        import pyarrow.dataset as ds

        if not self.table.exists():
            return []
        return ds.dataset(self.table, format="parquet", partitioning="hive").to_table().to_pylist()


@pytest.mark.slow
@kills_of(("random",))
def test_streaming_window_exactly_once_across_driver_sigkills(
    kafka_bootstrap: str,
    postgres_dsn: str,
    tmp_path: Path,
    unique_name: str,
    kills: tuple[str, ...],
) -> None:
    from collections import Counter

    import psycopg

    from examples.orders import read_committed

    job = WindowJob(kafka_bootstrap, unique_name, tmp_path, postgres_dsn)
    driver = StreamDriver(job, tmp_path / "spark-checkpoint", WINDOW_SPEC)
    rng = random.Random(15)
    try:
        job.produce(ORDERS_PER_ROUND)
        kill_and_restart(driver, lambda: job.produce(ORDERS_PER_ROUND), rng, kills)
        job.produce(ORDERS_PER_ROUND, flush=True)
        expected = job.expected
        # The flush order's event time closes every window: Spark fires their timers in the
        # batch after the one that saw it, within a few 1 s batches of a running driver.
        wait_for(
            "every window in the Parquet table",
            lambda: len(job.table_rows()) >= len(expected),
            120,
            driver.tail,
        )
        outputs = read_committed(kafka_bootstrap, job.out_topic, len(expected), settle=3.0)
        kafka = Counter((o["key"], o["start"]) for o in outputs)
        assert [w for w, n in kafka.items() if n > 1] == [], "Kafka: windows emitted twice"
        assert {
            (o["key"], o["start"]): (o["value"]["orders"], o["value"]["amount"]) for o in outputs
        } == expected, "Kafka: windows differ from the produced orders"
        rows = job.table_rows()
        assert len(rows) == len(expected), "Parquet: a window missing or written twice"
        assert {
            (r["customer"], r["window_start"]): (r["orders"], r["amount"]) for r in rows
        } == expected, "Parquet: windows differ from the produced orders"
        with psycopg.connect(postgres_dsn) as conn:
            db = conn.execute(
                f"SELECT customer, window_start, orders, amount FROM {job.pg_table}"
            ).fetchall()
        assert {(c, s): (n, a) for c, s, n, a in db} == expected, "PostgreSQL"
        log = driver.log.read_text(errors="replace")
        assert log.count("committed before a restart") >= kills.count("after-commit"), driver.tail()
    finally:
        if driver.process is not None and driver.process.poll() is None:
            driver.kill()


def _spark_stream(
    spec: str,
    tmp_path: Path,
    bootstrap: str,
    prefix: str,
    *args: str,
    env: dict[str, str] | None = None,
) -> None:
    """``snapline spark stream SPEC --trigger available-now``, to its end (bounded: a few small
    batches of input that is all there at start)."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "snapline.pipeline.cli",
            "spark",
            "stream",
            spec,
            "--checkpoint-location",
            str(tmp_path / "spark-checkpoint"),
            "--trigger",
            "available-now",
            "--master",
            "local[2]",
            "--state-partitions",
            "2",
            *args,
        ],
        cwd=tmp_path,
        env={
            **os.environ,
            "SNAPLINE_TEST_PREFIX": prefix,
            "PYTHONPATH": child_pythonpath(),
            "SNAPLINE_BOOTSTRAP_SERVERS": bootstrap,
            "SNAPLINE_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_sinks_and_branches_before_key_by_get_every_record_once(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """The part before key_by may feed sinks and branches of its own: every record goes raw to
    one sink, the even ones mapped to another, and the keyed count beside them counts each
    key's records 1..n, each output once."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}before-in": 4})
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    n = 300
    for i in range(n):
        producer.produce(f"{prefix}before-in", orjson.dumps({"n": i}), f"k{i % 7}".encode())
    assert producer.flush(30) == 0
    _spark_stream(
        "integration_tests.pipelines:before_key_by",
        tmp_path,
        kafka_bootstrap,
        prefix,
        "--max-records-per-batch",
        "100",
    )
    raw = read_committed(kafka_bootstrap, f"{prefix}before-raw", n, timeout=60)
    assert sorted(r["n"] for r in raw) == list(range(n)), "raw: a record lost or twice"
    even = read_committed(kafka_bootstrap, f"{prefix}before-even", n // 2, timeout=60)
    assert sorted(r["even"] for r in even) == list(range(0, n, 2))
    counts = read_committed(kafka_bootstrap, f"{prefix}before-counts", n, timeout=60)
    per_key: dict[str, list[int]] = {}
    for c in counts:
        per_key.setdefault(c["key"], []).append(c["value"])
    assert {k: sorted(v) for k, v in per_key.items()} == {
        f"k{k}": list(range(1, len(range(k, n, 7)) + 1)) for k in range(7)
    }


def test_two_sources_of_different_formats_meet_at_a_union_each_record_once(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Several sources were refused on Spark streaming. Now one Spark Kafka source reads all
    their topics and each record starts at its own source, decoded with its formats: JSON
    orders and text lines meet at a union, and per key the rolling count of both counts
    1..n, each output once; the lines' raw sink gets every line once."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}union-json": 4, f"{prefix}union-text": 4})
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    n_json, n_text = 200, 100
    for i in range(n_json):
        producer.produce(f"{prefix}union-json", orjson.dumps({"n": i}), f"k{i % 7}".encode())
    for i in range(n_text):
        producer.produce(f"{prefix}union-text", f"n={i}".encode(), f"k{i % 5}".encode())
    assert producer.flush(30) == 0
    _spark_stream(
        "integration_tests.pipelines:union_sources",
        tmp_path,
        kafka_bootstrap,
        prefix,
        "--max-records-per-batch",
        "100",
    )
    raw = read_committed(kafka_bootstrap, f"{prefix}union-text-raw", n_text, timeout=60)
    assert sorted(raw) == sorted(f"n={i}" for i in range(n_text)), "raw lines"
    expected = Counter(f"k{i % 7}" for i in range(n_json)) + Counter(
        f"k{i % 5}" for i in range(n_text)
    )
    counts = read_committed(kafka_bootstrap, f"{prefix}union-counts", n_json + n_text, timeout=60)
    per_key: dict[str, list[int]] = {}
    for c in counts:
        per_key.setdefault(c["key"], []).append(c["value"])
    assert {k: sorted(v) for k, v in per_key.items()} == {
        k: list(range(1, n + 1)) for k, n in expected.items()
    }, "a record of either source lost or counted twice"


def test_the_join_example_runs_on_spark_each_order_once_with_a_tier_its_customer_had(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """The services' join module (examples/enrich_orders.py: orders and profile updates, each
    re-keyed by customer, meet in one KeyedCoProcessFunction) as a Spark streaming query:
    connect was refused there. Each side's records start at their own key_by and call their
    side of the one function, whose state both share: every order is output once with the
    running totals of its customer, and with a tier that customer was given. Every customer's
    profile was written before its orders, all in one batch: a key's records of the two topics
    run interleaved by time, as a service task reads them (sorted by topic, every order ran
    before every profile update, and none was enriched)."""
    prefix = f"{unique_name}-"
    create_topics(
        kafka_bootstrap, {f"{prefix}{t}": 4 for t in ("orders", "profiles", "enriched-orders")}
    )
    rng = random.Random(5)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    customers = 40
    given: dict[str, set[str]] = {}
    for n in range(300):
        customer = f"c{n % customers:05d}" if n < customers else f"c{rng.randrange(customers):05d}"
        tier = rng.choice(["basic", "silver", "gold"])
        given.setdefault(customer, set()).add(tier)
        profile = {"customer": customer, "tier": tier}
        producer.produce(f"{prefix}profiles", orjson.dumps(profile), str(rng.random()).encode())
    assert producer.flush(30) == 0
    time.sleep(0.05)  # the orders' timestamps after every profile's
    orders = 2_000
    expected = produce_orders(
        kafka_bootstrap, f"{prefix}orders", orders, customers, keyed_by_order=True
    )
    _spark_stream(
        "examples.enrich_orders:pipeline",
        tmp_path,
        kafka_bootstrap,
        prefix,
        env={"SNAPLINE_EXAMPLE_PREFIX": prefix, "SNAPLINE_EXAMPLE_JOB": unique_name},
    )
    outputs = read_committed(kafka_bootstrap, f"{prefix}enriched-orders", orders, timeout=60)
    result = verify_totals(outputs, expected, range(orders))
    assert result.ok, result.summary()
    wrong = [o for o in outputs if o["tier"] not in given[o["customer"]]]
    assert not wrong, f"orders without a tier, or one their customer never had: {wrong[:5]}"


def test_a_join_whose_sides_key_by_an_int_and_a_string_of_the_same_bytes_matches(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """The services scope keyed state by the key's bytes: orders keyed by customer 17 and
    tiers keyed by "17" meet in one state. Spark grouped rows by the typed key, so such a
    join never matched, silently. With several key_bys the query now groups by the key's
    bytes, and each record still sees its own key (an int for an order)."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}mixed-{t}": 2 for t in ("orders", "tiers", "out")})
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for c in range(10):
        producer.produce(f"{prefix}mixed-tiers", orjson.dumps({"c": c, "tier": f"t{c}"}))
    assert producer.flush(30) == 0
    time.sleep(0.05)  # the orders' timestamps after every tier's
    n = 100
    for i in range(n):
        producer.produce(f"{prefix}mixed-orders", orjson.dumps({"n": i, "c": i % 10}))
    assert producer.flush(30) == 0
    _spark_stream("integration_tests.pipelines:mixed_key_join", tmp_path, kafka_bootstrap, prefix)
    out = read_committed(kafka_bootstrap, f"{prefix}mixed-out", n, timeout=60)
    assert sorted(o["n"] for o in out) == list(range(n)), "an order lost or output twice"
    assert all(o["key"] == o["n"] % 10 for o in out), "an order saw another key, or a string"
    unmatched = [o for o in out if o["tier"] != f"t{o['n'] % 10}"]
    assert not unmatched, f"orders that missed their customer's tier: {unmatched[:5]}"


def test_late_records_reach_the_keyed_part(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Spark drops every input row of a stateful operator whose watermark column is behind the
    watermark, before the processor sees it (before the fix, the rolling count below counted 5
    of the 7 records, silently). Snapline decides about late records
    itself: an operator without a window (a rolling count) counts every record, a window takes
    a record until its allowed lateness has passed, and a record after that is a dead letter.

    One record per micro-batch, so each batch's watermark is known: the largest event time of
    the batches before it. Spark fires a batch's due timers after its records, so a record
    sees the time just before the key's first due timer: that of the last batch, for a key
    whose window is due (docs/spark.md)."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}late-in": 1})
    # Event times of key "a", one per batch:
    # - 100 opens [0, 1000); 3000 opens [3000, 4000) and makes the next batch's watermark 3000;
    # - 200 joins [0, 1000), whose timer (999) fires after it in the same batch: 2 records;
    # - 20000 makes the watermark 20000: 300 comes in the batch that fires [3000, 4000) and
    #   ends [0, 1000)'s lateness (5999), after its records: it joins [0, 1000) (3 records);
    # - 20001; then 400 is late beyond the allowed lateness: a dead letter.
    times = [100, 3000, 200, 20000, 300, 20001, 400]
    assert 3000 < LATE_WINDOW_MS - 1 + LATE_ALLOWED_MS <= 20000
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    for t in times:
        producer.produce(f"{prefix}late-in", orjson.dumps({"t": t}), b"a")
    assert producer.flush(30) == 0
    _spark_stream(
        "integration_tests.pipelines:late_records",
        tmp_path,
        kafka_bootstrap,
        prefix,
        "--max-records-per-batch",
        "1",
    )
    counts = read_committed(kafka_bootstrap, f"{prefix}late-counts", len(times), timeout=60)
    assert sorted(o["value"] for o in counts) == list(range(1, len(times) + 1)), (
        f"the rolling count missed late records: {counts}"
    )
    windows = read_committed(kafka_bootstrap, f"{prefix}late-windows", 3, timeout=60)
    first = [o["value"] for o in windows if o["start"] == 0]
    assert first == [2, 3], f"window [0, 1000) fired {first}: a record lost or fired twice"
    assert [o["value"] for o in windows if o["start"] == 3000] == [1]
    dead = read_committed(kafka_bootstrap, f"{prefix}late.dead-letter", 1, timeout=60)
    assert [d["t"] for d in dead] == [400], f"late beyond the allowed lateness: {dead}"
