"""Streaming benchmark: the warehouse running total (orders keyed by customer; Kafka and Parquet
sinks) as services (``snapline run --workers 2``) and as a Spark Structured Streaming query
(``snapline spark stream``, ``local[2]``, 1 s trigger) on the same broker and machine.

    python -m benchmarks.spark_stream [--orders 50000] [--rate 500] [--seconds 20]

Two phases per system, both judged by an independent read_committed consumer of the output
topic (exactly-once checked: every order once, totals as produced):

1. **throughput**: ``--orders`` orders are in the topic before the system starts; records/s
   from the first to the last committed output (start-up excluded; meaningful only when the
   backlog spans several commits: the services may commit all of it at once) and from the
   process start (start-up included);
2. **latency**: then ``--rate`` orders/s for ``--seconds`` s; latency of an order = the time
   the reader saw its output − the time it was produced; p50 and p99.

Prints a table and writes ``benchmarks/results/spark-stream-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer, TopicPartition

from examples.orders import create_topics, produce_orders, verify_totals
from snapline.connectors.local.broker import LocalKafkaBroker

REPO = Path(__file__).resolve().parent.parent
CUSTOMERS = 5000


class OutputReader(threading.Thread):
    """Reads the output topic read_committed from the start; notes when each order's output
    was seen."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-reader-{time.time_ns()}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            }
        )
        partitions = self.consumer.list_topics(topic, timeout=30).topics[topic].partitions
        self.consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        self.outputs: list[dict[str, Any]] = []
        self.seen_at: dict[int, float] = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            for msg in self.consumer.consume(5000, 0.05):
                if msg.error() is None:
                    now = time.monotonic()
                    value = orjson.loads(msg.value())
                    self.outputs.append(value)
                    self.seen_at.setdefault(value["order_id"], now)
        self.consumer.close()

    def wait_for(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seen_at) < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"only {len(self.seen_at)} of {count} outputs in {timeout} s")
            time.sleep(0.05)


def _start(system: str, bootstrap: str, job: str, workdir: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SNAPLINE_BOOTSTRAP_SERVERS": bootstrap,
        "SNAPLINE_CHECKPOINT_DIR": str(workdir / "checkpoints"),
        "SNAPLINE_EXAMPLE_PREFIX": f"{job}-",
        "SNAPLINE_EXAMPLE_JOB": job,
        "SNAPLINE_WAREHOUSE": str(workdir / "table"),
    }
    spec = "examples.warehouse:pipeline"
    if system == "services":
        args = ["run", spec, "--workers", "2"]
    else:
        args = [
            "spark",
            "stream",
            spec,
            "--checkpoint-location",
            str(workdir / "spark-checkpoint"),
            "--trigger",
            "processing-time=1s",
            "--max-records-per-batch",
            "20000",
            "--state-partitions",
            "2",
        ]
    log = (workdir / "system.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "snapline.pipeline.cli", *args],
        env=env,
        cwd=workdir,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    bootstrap: str, system: str, root: Path, orders: int, rate: int, seconds: float
) -> dict[str, float]:
    job = f"bench-stream-{system}-{int(time.time())}"
    workdir = root / system
    workdir.mkdir(parents=True)
    orders_topic, totals_topic = f"{job}-orders", f"{job}-customer-totals"
    create_topics(bootstrap, {orders_topic: 2, totals_topic: 2})
    expected = produce_orders(bootstrap, orders_topic, orders, CUSTOMERS)
    reader = OutputReader(bootstrap, totals_topic)
    reader.start()
    started = time.monotonic()
    process = _start(system, bootstrap, job, workdir)
    try:
        reader.wait_for(orders, 900)
        times = sorted(reader.seen_at[i] for i in range(orders))
        first, last = times[0], times[-1]
        # Latency phase: orders at a fixed rate, each one's send time noted.
        # the partitioner of produce_orders: a customer stays in one partition
        producer = Producer(
            {"bootstrap.servers": bootstrap, "linger.ms": 0, "partitioner": "murmur2_random"}
        )
        sent: dict[int, float] = {}
        total = int(rate * seconds)
        t0 = time.monotonic()
        for i in range(total):
            due = t0 + i / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            order_id = orders + i
            customer = f"c{order_id % CUSTOMERS:05d}"
            producer.produce(
                orders_topic,
                orjson.dumps({"customer": customer, "amount": 1, "order_id": order_id}),
                customer.encode(),
            )
            producer.poll(0)
            sent[order_id] = time.monotonic()
            expected[customer] = expected.get(customer, 0) + 1
        producer.flush(30)
        reader.wait_for(orders + total, 300)
    finally:
        os.killpg(process.pid, signal.SIGTERM if system == "services" else signal.SIGKILL)
        process.wait(60)
        reader.stopping.set()
        reader.join(30)
    check = verify_totals(reader.outputs, expected, range(orders + total))
    if not check.ok:
        raise SystemExit(f"{system}: {check.summary()}")
    latencies = [(reader.seen_at[i] - t) * 1000 for i, t in sent.items()]
    return {
        "records_per_s": (orders - 1) / (last - first) if last > first else float("nan"),
        "wall_records_per_s": orders / (last - started),
        "startup_to_first_output_s": first - started,
        "latency_p50_ms": _percentile(latencies, 0.50),
        "latency_p99_ms": _percentile(latencies, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", type=int, default=50_000)
    parser.add_argument("--rate", type=int, default=500, help="orders/s of the latency phase")
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with LocalKafkaBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        bootstrap = broker.start()
        results = {
            system: measure(bootstrap, system, Path(tmp), args.orders, args.rate, args.seconds)
            for system in ("services", "spark-stream")
        }
    load_after = os.getloadavg()
    print(
        "| system | records/s first→last output | wall records/s | first output after | p50 | p99 |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for system, r in results.items():
        print(
            f"| {system} | {r['records_per_s']:,.0f} | {r['wall_records_per_s']:,.0f} | "
            f"{r['startup_to_first_output_s']:.1f} s | {r['latency_p50_ms']:,.0f} ms | "
            f"{r['latency_p99_ms']:,.0f} ms |"
        )
    print(f"load average {load_before} → {load_after}")
    out = REPO / "benchmarks" / "results" / f"spark-stream-{time.strftime('%Y%m%d-%H%M')}.json"
    out.write_text(
        json.dumps(
            {
                "orders": args.orders,
                "rate": args.rate,
                "seconds": args.seconds,
                "results": results,
                "load": [load_before, load_after],
            }
        )
    )


if __name__ == "__main__":
    main()
