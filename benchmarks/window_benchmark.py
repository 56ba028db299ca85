"""Windows benchmark: a per-key 1-minute tumbling count, Snapline vs Quix Streams, same run.

```
python -m benchmarks.window_benchmark [--records 300000] [--keys 1000] [--partitions 4]
                                      [--bootstrap-servers HOST:PORT] [--output PATH]
```

Both systems read the same input topic (JSON orders keyed by customer, Kafka timestamps
spanning ten minutes, in order per partition, then one far-future record per partition so
every window closes), count per customer and minute exactly-once (commit / checkpoint every
second) and write one result per window. **records/s** = input records / (time the verifier,
a read_committed consumer, saw the last expected window result − time the system consumed its
first record); every result is checked against the expected count.

**Latency**: a separate run per system with 1-second windows, records produced for 10 s at
a fixed rate with Kafka timestamp = produce time, so a window's end passes (the watermark
reaches it; Quix: the partition's largest timestamp passes it) at wall-clock time ≈ its end:
latency = time the verifier sees the result − window end. Target (issue 12): Snapline ≥ 3 ×
Quix records/s, latency p99 ≤ checkpoint interval + 250 ms.

Child modes: ``python -m benchmarks.window_benchmark quix`` (Quix Streams app) and
``snapline run benchmarks.window_benchmark:snapline_pipeline`` (both read ``BENCH_*``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from benchmarks.child_env import ChildEnv, StartMarker

REPO = Path(__file__).resolve().parent.parent
T0 = 1_790_000_040_000 - 1_790_000_040_000 % 60_000
END_KEY = "~end"


# ---------------------------------------------------------------- the two systems
def snapline_pipeline() -> Any:
    """The Snapline side: key_by() (the input is keyed by customer), tumbling count."""
    from snapline import KafkaSink, KafkaSource, Pipeline, tumbling

    env = ChildEnv.from_environ()
    window_ms = int(os.environ.get("BENCH_WINDOW_MS", "60000"))
    marker = StartMarker(env.start_file)

    def mark(value: Any) -> Any:
        marker.mark()
        return value

    pipeline = Pipeline(
        env.group,
        checkpoint_interval=env.commit_interval,
        state_backend=env.backend,
        checkpoint_dir=env.state_dir,
    )
    (
        pipeline.source(KafkaSource(env.in_topic, idle_timeout=None))
        .map(mark)
        .key_by()
        .window(tumbling(window_ms))
        .count()
        .sink(KafkaSink(env.out_topic))
    )
    return pipeline


def quix_main() -> None:
    """The Quix Streams side: tumbling_window(...).count().final(), exactly-once."""
    import logging
    import warnings

    from quixstreams import Application

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING)
    env = ChildEnv.from_environ()
    window_ms = int(os.environ.get("BENCH_WINDOW_MS", "60000"))
    app = Application(
        broker_address=env.bootstrap,
        consumer_group=env.group,
        auto_offset_reset="earliest",
        commit_interval=env.commit_interval,
        processing_guarantee="exactly-once",
        state_dir=env.state_dir,
        loglevel="WARNING",
        consumer_extra_config={"group.instance.id": f"{env.group}-0"},
        producer_extra_config={"transactional.id": f"{env.group}-0"},
    )
    source = app.topic(env.in_topic, value_deserializer="json", key_deserializer="string")
    sink = app.topic(env.out_topic, value_serializer="json", key_serializer="string")
    marker = StartMarker(env.start_file)

    def mark(value: Any) -> Any:
        marker.mark()
        return value

    sdf = app.dataframe(source).apply(mark)
    # "partition": a record closes the windows of every key of its partition (a watermark)
    sdf = sdf.tumbling_window(window_ms).count().final(closing_strategy="partition")
    sdf.to_topic(sink)
    app.run()


# ---------------------------------------------------------------- harness
def create_topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        topic = admin.list_topics(name, timeout=10).topics.get(name)
        if topic and topic.error is None and len(topic.partitions) == partitions:
            return
        time.sleep(0.1)
    raise TimeoutError(f"topic {name} not ready")


def produce_batch(
    bootstrap: str, topic: str, records: int, keys: int, partitions: int
) -> Counter[tuple[str, int]]:
    """Orders over ten minutes of event time; returns the expected count per (key, start)."""
    producer = Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 50, "enable.idempotence": True}
    )
    expected: Counter[tuple[str, int]] = Counter()
    span = 600_000
    for i in range(records):
        key = f"c{i % keys:06d}"
        ts = T0 + i * span // records
        expected[(key, ts - ts % 60_000)] += 1
        value = orjson.dumps({"customer": key, "amount": i % 100 + 1})
        while True:
            try:
                producer.produce(topic, value, key.encode(), timestamp=ts)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(120)
    for partition in range(partitions):  # every window of every partition closes
        producer.produce(
            topic, b"{}", END_KEY.encode(), partition=partition, timestamp=T0 + span * 2
        )
    producer.flush(120)
    return expected


def start_system(system: str, env: ChildEnv, window_ms: int, log: Path) -> subprocess.Popen[bytes]:
    environ = {
        **os.environ,
        **env.to_environ(),
        "BENCH_WINDOW_MS": str(window_ms),
        "PYTHONPATH": str(REPO),
    }
    if system == "quix":
        argv = [sys.executable, "-m", "benchmarks.window_benchmark", "quix"]
    else:
        argv = [
            sys.executable,
            "-m",
            "snapline.pipeline.cli",
            "run",
            "benchmarks.window_benchmark:snapline_pipeline",
            "--bootstrap-servers",
            env.bootstrap,
            "--checkpoint-dir",
            env.state_dir + "/checkpoints",
            "--worker-id",
            "0",
        ]
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=environ, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def window_key(system: str, msg: Any) -> tuple[str, int, int, int] | None:
    value = orjson.loads(msg.value())
    if system == "quix":
        key = msg.key().decode()
        return (key, value["start"], value["end"], value["value"])
    return (value["key"], value["start"], value["end"], value["value"])


IGNORED = {END_KEY, "warmup", "tick"}


def verify(
    bootstrap: str,
    system: str,
    topic: str,
    done: Callable[[list[tuple[str, int, int, int]]], bool],
    timeout: float,
    seen: list[float] | None = None,
    results: list[tuple[str, int, int, int]] | None = None,
) -> tuple[list[tuple[str, int, int, int]], list[float]]:
    """Window results (read_committed) and the time each was seen, until ``done(results)``
    (checked on every poll, so a verifier may run while the input is produced)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"verify-{time.time_ns()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 10,
        }
    )
    partitions = list(consumer.list_topics(topic, timeout=30).topics[topic].partitions)
    consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
    results = [] if results is None else results
    seen = [] if seen is None else seen
    deadline = time.monotonic() + timeout
    try:
        while not done(results) and time.monotonic() < deadline:
            for msg in consumer.consume(10000, 0.05):
                if msg.error() is None:
                    result = window_key(system, msg)
                    if result is not None and result[0] not in IGNORED:
                        results.append(result)
                        seen.append(time.time())
    finally:
        consumer.close()
    return results, seen


def throughput_run(
    bootstrap: str, system: str, records: int, keys: int, partitions: int, work: Path
) -> dict[str, Any]:
    name = f"winbench-{system}-{time.time_ns()}"
    create_topic(bootstrap, f"{name}-in", partitions)
    create_topic(bootstrap, f"{name}-out", partitions)
    expected = produce_batch(bootstrap, f"{name}-in", records, keys, partitions)
    state = work / name
    state.mkdir(parents=True)
    env = ChildEnv(
        bootstrap,
        f"{name}-in",
        f"{name}-out",
        name,
        str(state / "start"),
        str(state / "stats"),
        str(state),
    )
    proc = start_system(system, env, 60_000, work / f"{name}.log")
    try:
        results, seen = verify(
            bootstrap, system, f"{name}-out", lambda r: len(r) >= len(expected), 300
        )
    finally:
        stop(proc)
    got = Counter({(k, s): v for k, s, _, v in results})
    dupes = len(results) - len({(k, s) for k, s, _, _ in results})
    correct = dict(got) == dict(expected) and dupes == 0
    started = (
        float(Path(env.start_file).read_text().strip()) if Path(env.start_file).exists() else 0
    )
    seconds = (seen[-1] - started) if seen and started else float("nan")
    return {
        "system": system,
        "records": records,
        "windows": len(expected),
        "results": len(results),
        "duplicates": dupes,
        "correct": correct,
        "seconds": seconds,
        "records_per_s": records / seconds if correct else None,
    }


def latency_run(
    bootstrap: str, system: str, keys: int, partitions: int, work: Path, rate: int = 2000
) -> dict[str, Any]:
    name = f"winlat-{system}-{time.time_ns()}"
    create_topic(bootstrap, f"{name}-in", partitions)
    create_topic(bootstrap, f"{name}-out", partitions)
    state = work / name
    state.mkdir(parents=True)
    env = ChildEnv(
        bootstrap,
        f"{name}-in",
        f"{name}-out",
        name,
        str(state / "start"),
        str(state / "stats"),
        str(state),
    )
    proc = start_system(system, env, 1_000, work / f"{name}.log")
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    try:
        # Warm up: until the system consumes.
        deadline = time.monotonic() + 60
        while not Path(env.start_file).exists() and time.monotonic() < deadline:
            producer.produce(f"{name}-in", b"{}", b"warmup")
            producer.flush(5)
            time.sleep(0.2)
        time.sleep(2)
        # The verifier runs while the input is produced: it stamps each result as it appears.
        results: list[tuple[str, int, int, int]] = []
        seen: list[float] = []
        finished = threading.Event()
        reader = threading.Thread(
            target=verify,
            args=(
                bootstrap,
                system,
                f"{name}-out",
                lambda _: finished.is_set(),
                120,
                seen,
                results,
            ),
            daemon=True,
        )
        reader.start()
        begin = time.time()
        sent = 0
        expected_windows: set[tuple[str, int]] = set()
        while time.time() - begin < 10:
            now = time.time()
            due = int((now - begin) * rate)
            while sent < due:
                key = f"k{sent % keys}"
                ts = int(time.time() * 1000)
                producer.produce(f"{name}-in", b"{}", key.encode(), timestamp=ts)
                expected_windows.add((key, ts - ts % 1000))
                sent += 1
            producer.poll(0)
            time.sleep(0.002)
        last_start = int(time.time() * 1000) // 1000 * 1000
        # keep one record per partition flowing for 2 s past the last window so it closes
        for _ in range(20):
            for p in range(partitions):
                producer.produce(
                    f"{name}-in", b"{}", b"tick", partition=p, timestamp=int(time.time() * 1000)
                )
            producer.flush(5)
            time.sleep(0.1)
        closed = {w for w in expected_windows if w[1] + 1000 <= last_start}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not closed <= {(k, st) for k, st, _, _ in results}:
            time.sleep(0.2)
        finished.set()
        reader.join(30)
    finally:
        stop(proc)
    latencies = [
        (at - (end / 1000)) * 1000
        for (key, start, end, _), at in zip(results, seen, strict=True)
        if (key, start) in closed
    ]
    latencies.sort()

    def pct(q: float) -> float:
        return (
            latencies[min(len(latencies) - 1, int(q * len(latencies)))]
            if latencies
            else float("nan")
        )

    return {
        "system": system,
        "windows": len(latencies),
        "latency_p50_ms": pct(0.5),
        "latency_p99_ms": pct(0.99),
        "latency_mean_ms": statistics.fmean(latencies) if latencies else float("nan"),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "quix":
        quix_main()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--bootstrap-servers", default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    from benchmarks.broker import kafka

    rows = []
    with kafka(args.bootstrap_servers) as bootstrap, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for system in ("snapline", "quix"):
            rows.append(
                throughput_run(bootstrap, system, args.records, args.keys, args.partitions, work)
            )
            print(json.dumps(rows[-1]), flush=True)
        for system in ("snapline", "quix"):
            rows.append(latency_run(bootstrap, system, 100, args.partitions, work))
            print(json.dumps(rows[-1]), flush=True)
    by = {(r["system"], "records_per_s" in r): r for r in rows}
    snap, quix = by.get(("snapline", True)), by.get(("quix", True))
    print("\nsystem     records/s   correct   latency p50 / p99 (ms, window end -> visible)")
    for system in ("snapline", "quix"):
        t, lat = by.get((system, True), {}), by.get((system, False), {})
        rate = t.get("records_per_s")
        print(
            f"{system:9s} {rate or 0:11,.0f}   {t.get('correct')!s:7s}   "
            f"{lat.get('latency_p50_ms', float('nan')):8.0f} / "
            f"{lat.get('latency_p99_ms', float('nan')):.0f}"
        )
    if snap and quix and snap.get("records_per_s") and quix.get("records_per_s"):
        print(f"Snapline / Quix: {snap['records_per_s'] / quix['records_per_s']:.2f} x")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
