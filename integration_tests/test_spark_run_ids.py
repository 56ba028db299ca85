"""Two jobs' `snapline spark run`s given one ``--run-id`` (a natural name such as ``backfill``)
must not fence each other's Kafka transactions: the bounded runner's transactional id was
``snapline-spark-<run>-<task>``, the same for every job, so a task's ``init_transactions``
aborted the other job's open transaction (its task failed, and its retry fenced back). It is
``snapline-spark-<job>-<task>`` now. Real broker, real PySpark (``local[1]``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from examples.orders import create_topics, read_committed
from examples.workers import run_snapline
from snapline.pipeline.runtime.kafka_calls import delete_records
from snapline.pipeline.spark.bounded import _transactional_id
from snapline.pipeline.stages import SOURCE_STAGE, task_id_for

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.slow]


def test_two_jobs_spark_runs_with_one_run_id_do_not_fence_each_other_and_reruns_see_the_run(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Then: the run's ledger (a consumer group's committed offset per task) expires
    offsets.retention.minutes after its commit. A re-run with the run's id found every task
    "not committed" and wrote its output again; it is refused now (each task leaves a
    committed mark in checkpoint storage), and writes nothing."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}copy-in": 1, f"{prefix}copy-out": 1})
    source = Producer({"bootstrap.servers": kafka_bootstrap})
    for n in range(3):
        source.produce(f"{prefix}copy-in", orjson.dumps({"n": n}))
    source.flush(30)

    # Job "<prefix>job-x"'s task of run "backfill" has its transaction open, output produced.
    task = f"spark-backfill-{task_id_for(SOURCE_STAGE, 0)}"
    other = Producer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "transactional.id": _transactional_id(f"{prefix}job-x", task),
        }
    )
    other.init_transactions(30)
    other.begin_transaction()
    other.produce(f"{prefix}copy-out", orjson.dumps({"n": "other job"}))
    other.flush(30)

    # Job "<prefix>job" runs on Spark with the same run id, over the same input.
    result = _spark_run(kafka_bootstrap, tmp_path, prefix)
    assert result.returncode == 0, result.stderr[-4000:]

    # The other job's transaction was left alone: it commits (fenced, this raised _FENCED).
    other.commit_transaction(30)
    outputs = read_committed(kafka_bootstrap, f"{prefix}copy-out", 4, timeout=60, settle=2)
    assert sorted(str(o["n"]) for o in outputs) == ["0", "1", "2", "other job"]

    # The ledger expires (its group's offsets deleted, as retention does); the re-run of the
    # run is refused, naming why, and writes nothing.
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    ledger = f"snapline-spark-backfill-{task}"
    admin.delete_consumer_groups([ledger], request_timeout=30)[ledger].result(timeout=35)
    again = _spark_run(kafka_bootstrap, tmp_path, prefix)
    assert again.returncode != 0
    assert "offsets expired" in again.stderr + again.stdout, again.stderr[-4000:]
    outputs = read_committed(kafka_bootstrap, f"{prefix}copy-out", 4, timeout=30, settle=5)
    assert sorted(str(o["n"]) for o in outputs) == ["0", "1", "2", "other job"]


def test_a_range_that_retention_deleted_in_part_is_refused_before_spark_runs(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Found by review: Spark's Kafka source was given failOnDataLoss=false. A run over a range
    whose first records retention had deleted output the 41 records left of 100, exited 0,
    and its savepoint claimed the whole range. Now the range is checked against the log start
    and end first, and Spark reads with failOnDataLoss=true (a deletion racing the run)."""
    prefix = f"{unique_name}-"
    source = f"{prefix}copy-in"
    create_topics(kafka_bootstrap, {source: 1, f"{prefix}copy-out": 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for n in range(100):
        producer.produce(source, orjson.dumps({"n": n}))
    producer.flush(30)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in delete_records(admin, [TopicPartition(source, 0, 60)]).values():
        future.result(timeout=35)
    result = _spark_run(
        kafka_bootstrap, tmp_path, prefix, "--from", orjson.dumps({source: {"0": 0}}).decode()
    )
    assert result.returncode != 0
    assert f"{source}[0]: offsets [0, 60) were deleted" in result.stderr, result.stderr[-3000:]
    assert "Nothing was run" in result.stderr
    assert read_committed(kafka_bootstrap, f"{prefix}copy-out", 0, timeout=5, settle=2) == []


def _spark_run(
    bootstrap: str, tmp_path: Path, prefix: str, *args: str
) -> subprocess.CompletedProcess[str]:
    return run_snapline(
        "spark",
        "run",
        "integration_tests.pipelines:named_copy",
        "--run-id",
        "backfill",
        "--master",
        "local[1]",
        *args,
        cwd=tmp_path,
        env={
            "SNAPLINE_TEST_PREFIX": prefix,
            "SNAPLINE_BOOTSTRAP_SERVERS": bootstrap,
            "SNAPLINE_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        },
    )
