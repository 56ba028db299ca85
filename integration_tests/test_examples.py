"""The examples the README points at run for real: word count per channel (MapState), and
``snapline run --workers 2`` supervising two workers that SIGTERM stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.word_count import WORD
from examples.workers import child_pythonpath

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent


def _run(
    spec: str, bootstrap: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "snapline.pipeline.cli",
            "run",
            spec,
            "--bootstrap-servers",
            bootstrap,
            "--checkpoint-dir",
            str(tmp_path / "chk"),
            *args,
        ],
        cwd=tmp_path,
        env={**os.environ, **(env or {}), "PYTHONPATH": child_pythonpath()},
        stdout=open(tmp_path / "run.log", "ab"),
        stderr=subprocess.STDOUT,  # noqa: SIM115
    )


def _wait_for_leaders(bootstrap: str, topic: str) -> None:
    """A just-created topic answers only once its partitions have leaders."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"wm-{time.time_ns()}"})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                consumer.get_watermark_offsets(TopicPartition(topic, 0), 5)
                return
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        consumer.close()


def test_word_count_per_channel(kafka_bootstrap: str, tmp_path: Path, unique_name: str) -> None:
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}chat": 4, f"{prefix}word-counts": 4})
    _wait_for_leaders(kafka_bootstrap, f"{prefix}word-counts")
    lines = [
        ("general", "Hello world hello"),
        ("random", "it's a small world"),
        ("general", "world peace"),
        ("random", ""),
        ("general", "HELLO again"),
    ]
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": "murmur2_random"})
    for channel, line in lines:
        producer.produce(f"{prefix}chat", line.encode(), channel.encode())
    producer.flush(10)
    expected = Counter((c, w) for c, line in lines for w in WORD.findall(line.lower()))
    proc = _run(
        "examples.word_count:pipeline",
        kafka_bootstrap,
        tmp_path,
        "--worker-id",
        "w0",
        env={"SNAPLINE_EXAMPLE_PREFIX": prefix, "SNAPLINE_EXAMPLE_JOB": unique_name},
    )
    try:
        reader = Consumer(
            {
                "bootstrap.servers": kafka_bootstrap,
                "group.id": f"r{time.time_ns()}",
                "isolation.level": "read_committed",
            }
        )
        reader.assign([TopicPartition(f"{prefix}word-counts", p, 0) for p in range(4)])
        rows: list[dict] = []
        deadline = time.monotonic() + 60
        while len(rows) < sum(expected.values()) and time.monotonic() < deadline:
            rows += [orjson.loads(m.value()) for m in reader.consume(100, 0.5) if not m.error()]
        reader.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    final: dict[tuple[str, str], int] = {}
    for row in rows:
        key = (row["channel"], row["word"])
        final[key] = max(final.get(key, 0), row["count"])
    assert len(rows) == sum(expected.values())
    assert final == dict(expected)


def test_supervisor_runs_workers_and_stops_them_cleanly(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}orders": 4, f"{prefix}customer-totals": 4})
    expected = produce_orders(kafka_bootstrap, f"{prefix}orders", 10_000, 100)
    proc = _run(
        "examples.running_total:pipeline",
        kafka_bootstrap,
        tmp_path,
        "--workers",
        "2",
        "--worker-id",
        "sup",
        env={"SNAPLINE_EXAMPLE_PREFIX": prefix, "SNAPLINE_EXAMPLE_JOB": unique_name},
    )
    try:
        outputs = read_committed(
            kafka_bootstrap, f"{prefix}customer-totals", 10_000, timeout=90, settle=2
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
    log = (tmp_path / "run.log").read_text(errors="replace")
    assert code == 0, log[-3000:]
    assert "started worker sup-0" in log and "started worker sup-1" in log
    assert verify_totals(outputs, expected, range(10_000)).ok
