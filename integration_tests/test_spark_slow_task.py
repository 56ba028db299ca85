"""A bounded Spark task that runs for longer than ``transaction.timeout.ms`` commits: its
Kafka output is held while it runs and its transaction opens only when it has run. Before,
the transaction opened before the first record: the broker aborted it once the timeout
passed, and every attempt of the task failed at its commit. Real broker, the Spark task's
code run in this process (no Spark needed to show it)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from examples.orders import create_topics, read_committed
from snapline.pipeline.savepoint.control import control_topic
from snapline.pipeline.spark import bounded
from snapline.pipeline.spark.bounded import RunConfig, run_stage_task
from snapline.pipeline.stages import SOURCE_STAGE, task_id_for

pytestmark = [pytest.mark.integration]

#: The broker looks for timed-out transactions every 10 s
#: (transaction.abort.timed.out.transaction.cleanup.interval.ms): the task outlasts the
#: timeout by more than that.
TIMEOUT_MS = 2_000
RECORDS, PAUSE = 25, 0.5


def test_a_task_slower_than_the_transaction_timeout_commits_its_output_once(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = f"{unique_name}-"
    monkeypatch.setenv("SNAPLINE_TEST_PREFIX", prefix)
    monkeypatch.setenv("SNAPLINE_TEST_SLEEP", str(PAUSE))
    monkeypatch.setattr(bounded.Feed, "CHUNK", 1)  # the first record goes out at once
    control = control_topic(f"{prefix}job")  # the ledger's topic: the driver creates it
    create_topics(kafka_bootstrap, {f"{prefix}copy-in": 1, f"{prefix}copy-out": 1, control: 1})
    config = RunConfig(
        spec="integration_tests.pipelines:slow_copy",
        run_id="slow",
        kafka_config={"bootstrap.servers": kafka_bootstrap, "transaction.timeout.ms": TIMEOUT_MS},
        checkpoint_dir=str(tmp_path / "checkpoints"),
        savepoint_out=str(tmp_path / "savepoint"),
        savepoint_in=None,
        stage_partitions={SOURCE_STAGE: 1},
    )
    rows = [
        (f"{prefix}copy-in", n, None, orjson.dumps({"n": n}), 1_000 + n) for n in range(RECORDS)
    ]
    out = list(run_stage_task(config, SOURCE_STAGE, 0, rows))
    assert ("count", SOURCE_STAGE, RECORDS, 0) in out

    outputs = read_committed(kafka_bootstrap, f"{prefix}copy-out", RECORDS, timeout=60, settle=2)
    assert sorted(o["n"] for o in outputs) == list(range(RECORDS))
    task_id = f"spark-slow-{task_id_for(SOURCE_STAGE, 0)}"
    ledger = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": f"snapline-spark-slow-{task_id}"}
    )
    try:
        (offset,) = ledger.committed([TopicPartition(control, 0)], 30)
    finally:
        ledger.close()
    assert offset.offset == 1  # the commit point was passed, once
