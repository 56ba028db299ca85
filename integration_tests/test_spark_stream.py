"""The same pipeline on Spark, continuous (issue 14): the warehouse running total as a
Structured Streaming query on real PySpark (local[2]) reading a real broker, into Kafka,
Parquet and PostgreSQL. Orders keep arriving while the driver process (with its JVM and Python
workers: the whole process group) is SIGKILLed at random moments, 5 times, and restarted from
its checkpoint location. Independent readers (read_committed consumer, pyarrow, SQL) find every
order exactly once and the per-customer totals equal the ones computed by the producer.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.workers import REPO
from integration_tests.warehouse_job import SPEC, WarehouseJob, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.postgres]

KILLS = 5
ORDERS_PER_ROUND = 400


class StreamDriver:
    """``snapline spark stream`` as a subprocess in its own process group (driver, JVM and
    Spark's Python workers die together, like a crashed machine)."""

    def __init__(self, job: WarehouseJob, location: Path) -> None:
        self.job = job
        self.location = location
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
                    SPEC,
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
                    "PYTHONPATH": str(REPO),
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


def test_streaming_running_total_exactly_once_across_driver_sigkills(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str
) -> None:
    job = WarehouseJob(
        kafka_bootstrap, unique_name, tmp_path, postgres_dsn, partitions=2, customers=50, workers=0
    )
    driver = StreamDriver(job, tmp_path / "spark-checkpoint")
    job.logs = driver.tail  # type: ignore[method-assign]  # failure messages show the driver
    rng = random.Random(14)
    try:
        job.produce(ORDERS_PER_ROUND)
        # Kills at random moments of a run, and kills right after a batch's Kafka commit point
        # (before Parquet and PostgreSQL publish it and before Spark marks it done).
        for kind in ("random", "after-commit", "random", "after-commit", "random"):
            if kind == "after-commit":
                driver.start(kill_after_commit=True)
                job.produce(ORDERS_PER_ROUND)  # input flows while the query runs
                driver.wait_self_kill(150)
            else:
                driver.start()
                driver.wait_started(90)
                job.produce(ORDERS_PER_ROUND)
                time.sleep(rng.uniform(1.0, 10.0))  # mostly inside the first batch (15-30 s)
                driver.kill()
        driver.start()
        job.produce(ORDERS_PER_ROUND)
        # Every order reaches the Parquet table within a few 1 s batches of a running driver.
        wait_for(
            "every order in the Parquet table",
            lambda: len(job.table_rows()) >= job.produced,
            120,
            driver.tail,
        )
        assert driver.runs == KILLS + 1
        job.verify()  # Kafka, Parquet and PostgreSQL: each order once, totals as expected
        # The batches committed to Kafka just before a kill were re-run by Spark and skipped.
        log = driver.log.read_text(errors="replace")
        assert log.count("committed before a restart") >= 2, driver.tail()
    finally:
        if driver.process is not None and driver.process.poll() is None:
            driver.kill()
