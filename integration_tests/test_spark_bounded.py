"""The same pipeline on Spark, bounded (issue 13): a backfill of 200k orders through the 2-stage
warehouse pipeline on real PySpark (local[2]) reading a real broker with Spark's Kafka source,
into Kafka, Parquet and PostgreSQL, with a Spark task failing after its commit point (Spark
retries it); then the services continue from the run's savepoint with live input and SIGKILLs.
Independent readers (read_committed consumer, pyarrow, SQL) find every order exactly once and
the per-customer totals equal the expected ones: the Spark run's results are the services'.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from integration_tests.warehouse_job import (
    SPEC,
    WarehouseJob,
    kill_randomly,
    snapline,
    start_from_savepoint,
)

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.postgres, pytest.mark.slow]

ORDERS = 200_000


def test_backfill_on_spark_then_services_continue_exactly_once(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=4,
        keyed_by_order=True,
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2"},
    )
    jobs.append(job)
    job.produce(ORDERS)
    savepoint = snapline(
        job,
        "spark",
        "run",
        SPEC,
        "--master",
        "local[2,4]",
        env={"SNAPLINE_SPARK_FAIL_AFTER_COMMIT": "s1-p1"},  # retried after its commit point
    )
    assert Path(savepoint, "_savepoint.json").exists()
    spark_log = (job.workdir / "cli-stderr.log").read_text()
    assert "injected failure of" in spark_log, "the Spark task failure was not injected"
    assert f"{ORDERS} source records" in spark_log
    job.verify()  # the backfill alone: every order once in Kafka, Parquet and PostgreSQL
    attempts = list((job.checkpoint_dir / job.name / "spark").glob("*/*s1-p1-*.json"))
    assert attempts, "the failing task's pre-commit record is missing"

    start_from_savepoint(job, savepoint, 4)
    kill_randomly(job, 5, random.Random(23), 30_000)
    job.verify()  # backfill + live: every order once, totals continue from Spark's state
    job.stop_all()
