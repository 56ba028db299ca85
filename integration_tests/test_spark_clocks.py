"""A Spark run started from a services' savepoint goes on at the services' event time, and its
own savepoint carries its tasks' clocks (found by review: a Spark task started at the minimum
watermark, so a record late for a window the services had fired and purged opened it again
and fired it a second time; a services restore from a Spark savepoint started over too).
Real broker, a real worker, real PySpark (``local[1]``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer

from examples.orders import create_topics, read_committed
from examples.workers import WorkerProcess, run_snapline
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.savepoint.format import read_metadata

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.slow]
SPEC = "integration_tests.pipelines:window_counts"


def test_a_spark_run_from_a_savepoint_goes_on_at_the_services_event_time(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    source, out = f"{prefix}win-in", f"{prefix}win-out"
    create_topics(kafka_bootstrap, {source: 1, out: 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(*events: tuple[str, int]) -> None:
        for key, t in events:
            producer.produce(source, orjson.dumps({"k": key, "t": t}))
        producer.flush(30)

    cli_env = {
        "SNAPLINE_TEST_PREFIX": prefix,
        "SNAPLINE_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SNAPLINE_CHECKPOINT_DIR": str(tmp_path / "chk"),
    }

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run_snapline(*args, cwd=tmp_path, env=cli_env)

    # The services: window [0, 1000) of key a fires (count 2) once t=5000 passes; purged.
    produce(("a", 100), ("a", 200), ("z", 5000))
    env = {"SNAPLINE_TEST_PREFIX": prefix}
    worker = WorkerProcess(SPEC, "w0", kafka_bootstrap, tmp_path / "chk", tmp_path, env)
    worker.start()
    fired = read_committed(kafka_bootstrap, out, 1, timeout=60, settle=1)
    assert worker.stop() == 0
    assert [(o["key"], o["start"], o["value"]) for o in fired] == [("a", 0, 2)]
    saved = cli("savepoint", "from-checkpoint", SPEC)
    assert saved.returncode == 0, saved.stderr[-3000:]
    savepoint = saved.stdout.strip().splitlines()[-1]

    # Spark goes on from the savepoint: a is late for [0, 1000); z at 9000 closes [5000, 6000).
    produce(("a", 300), ("z", 9000))
    run = cli("spark", "run", SPEC, "--from", f"savepoint:{savepoint}", "--master", "local[1]")
    assert run.returncode == 0, run.stderr[-4000:]
    outputs = read_committed(kafka_bootstrap, out, 2, timeout=60, settle=3)
    windows = sorted((o["key"], o["start"], o["value"]) for o in outputs)
    assert windows == [("a", 0, 2), ("z", 5000, 1)]  # [0, 1000) of a did not fire again
    letters = read_committed(kafka_bootstrap, f"{prefix}win.dead-letter", 1, timeout=30, settle=1)
    assert [(d["k"], d["t"]) for d in letters] == [("a", 300)]
    # The run's savepoint carries its clocks: the services go on from its event time.
    spark_savepoint = run.stdout.strip().splitlines()[-1]
    clocks = read_metadata(CheckpointStorage(spark_savepoint)).clocks
    assert clocks["s1-p0"]["watermark"] >= 8_999, clocks
