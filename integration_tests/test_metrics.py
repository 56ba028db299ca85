"""Prometheus metrics of a running 2-worker job (``snapline run --workers 2 --metrics-port``),
scraped over HTTP from each worker: the series exist, counters move, lag drops to 0."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.orders import create_topics, produce_orders
from examples.workers import child_pythonpath

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
PARTITIONS = 4

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _free_port_pair() -> int:
    """A port P such that P and P+1 are free (worker i of --workers serves on P+i)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise AssertionError("no two consecutive free ports")


def scrape(port: int) -> Samples | None:
    """Every sample of the endpoint by name, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((dict(sample.labels), float(sample.value)))
    return samples


def total(samples: list[Samples], name: str, **labels: str) -> float:
    return sum(
        value
        for s in samples
        for got, value in s.get(name, [])
        if all(got.get(k) == v for k, v in labels.items())
    )


def wait_for(what: str, predicate, timeout: float, proc: subprocess.Popen[bytes], log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    raise AssertionError(f"{what}: not within {timeout} s (job exit {proc.poll()})\n{tail}")


@pytest.mark.parametrize("stages", [1, 2])
def test_two_workers_serve_metrics_that_move(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, stages: int
) -> None:
    """``stages=2`` re-keys through a repartition topic: tasks s1-p<i> (label stage "1")
    read it, and its lag (a transactional topic with commit markers) drops to 0 too."""
    prefix = f"{unique_name}-"
    job = f"{unique_name}-job"
    create_topics(kafka_bootstrap, {f"{prefix}orders": PARTITIONS, f"{prefix}customer-totals": 2})
    produce_orders(kafka_bootstrap, f"{prefix}orders", 2000, customers=40)
    port = _free_port_pair()
    log = tmp_path / "job.log"
    env = {
        **os.environ,
        "PYTHONPATH": child_pythonpath(),
        "SNAPLINE_EXAMPLE_PREFIX": prefix,
        "SNAPLINE_EXAMPLE_JOB": job,
        "SNAPLINE_EXAMPLE_INTERVAL": "0.5",
        "SNAPLINE_EXAMPLE_STAGES": str(stages),
    }
    tasks = {f"p{i}" for i in range(PARTITIONS)}
    topics = {f"{prefix}orders"}
    if stages == 2:
        tasks |= {f"s1-p{i}" for i in range(PARTITIONS)}
        topics.add(f"{job}.by-customer.repartition")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "snapline.pipeline.cli",
                "run",
                "examples.running_total:pipeline",
                "--workers",
                "2",
                "--worker-id",
                "m",
                "--metrics-port",
                str(port),
                "--bootstrap-servers",
                kafka_bootstrap,
                "--checkpoint-dir",
                str(tmp_path / "chk"),
            ],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def both() -> list[Samples] | None:
            scraped = [scrape(port), scrape(port + 1)]
            return None if None in scraped else scraped  # type: ignore[return-value]

        def read_all(at_least: int):
            def check() -> list[Samples] | None:
                scraped = both()
                # state entries are sampled once a second: after a rebalance the new tasks'
                # gauges appear with the next sample
                if (
                    scraped
                    and total(scraped, "snapline_records_in_total") >= at_least
                    and any(s.get("snapline_state_entries") for s in scraped)
                ):
                    return scraped
                return None

            return check

        first = wait_for("2000 records read", read_all(2000), 120, proc, log)
        workers = {labels["worker"] for s in first for labels, _ in s.get("snapline_tasks", [])}
        assert workers == {"m-0", "m-1"}, workers
        for name in (
            "snapline_records_in_total",
            "snapline_records_out_total",
            "snapline_dead_letters_total",
            "snapline_state_entries",
        ):
            series = [labels for s in first for labels, _ in s.get(name, [])]
            assert series, f"no {name}"
            for labels in series:
                stage = "1" if labels["task"].startswith("s1-") else "0"
                assert labels["job"] == job and labels["stage"] == stage
                assert labels["task"] in tasks and labels["worker"] in workers
        seen_tasks = {labels["task"] for s in first for labels, _ in s["snapline_records_in_total"]}
        assert seen_tasks == tasks
        assert total(first, "snapline_records_out_total") >= 2000
        for name in (
            "snapline_held_output_records",
            "snapline_worker_restarts",
            "snapline_restores_total",
            "snapline_restore_duration_seconds_count",
            "process_start_time_seconds",
        ):
            assert any(s.get(name) for s in first), f"no {name}"

        def checkpoints_done(at_least: float):
            def check() -> list[Samples] | None:
                scraped = both()
                done = scraped and total(scraped, "snapline_checkpoints_total", status="completed")
                # the gauge of a task that moved is removed by its old owner and set by the new
                # one at its restore: a scrape between the two has none
                last = scraped and any(s.get("snapline_last_checkpoint_id") for s in scraped)
                return scraped if done and done >= at_least and last else None

            return check

        after = wait_for("a completed checkpoint", checkpoints_done(1), 60, proc, log)
        for phase in ("alignment", "materialize", "commit", "total"):
            assert total(after, "snapline_checkpoint_duration_seconds_count", phase=phase) >= 1
        for phase in ("sync", "alignment", "async"):
            assert total(after, "snapline_task_checkpoint_duration_seconds_count", phase=phase) >= 1
        assert total(after, "snapline_checkpoint_size_bytes", kind="full") > 0
        assert total(after, "snapline_checkpoint_uploaded_bytes_total") > 0
        assert all(v >= 1 for _, v in (x for s in after for x in s["snapline_last_checkpoint_id"]))
        completed = total(after, "snapline_checkpoints_total", status="completed")
        read = total(after, "snapline_records_in_total")

        # More input: the counters move, then lag is 0 on every partition once it stops.
        produce_orders(kafka_bootstrap, f"{prefix}orders", 1000, customers=40, start_id=2000)
        wait_for("1000 more records read", read_all(int(read) + 1000), 90, proc, log)

        def lag_zero() -> list[Samples] | None:
            scraped = both()
            if not scraped:
                return None
            lag = [
                (labels, v)
                for s in scraped
                for labels, v in s.get("snapline_consumer_lag_records", [])
            ]
            parts = {(labels["topic"], labels["partition"]) for labels, _ in lag}
            every = {(t, str(i)) for t in topics for i in range(PARTITIONS)}
            if parts == every and all(v == 0 for _, v in lag):
                return scraped
            return None

        final = wait_for("lag 0 on every partition", lag_zero, 60, proc, log)
        lag_labels = [labels for s in final for labels, _ in s["snapline_consumer_lag_records"]]
        assert {labels["topic"] for labels in lag_labels} == topics
        wait_for("more checkpoints", checkpoints_done(completed + 1), 60, proc, log)
        text = log.read_text(errors="replace")
        assert f"http://0.0.0.0:{port}/metrics" in text and f":{port + 1}/metrics" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, log.read_text(errors="replace")[-3000:]
    text = log.read_text(errors="replace")
    # SIGTERM names the final checkpoint of each worker.
    assert (
        len(
            re.findall(
                r"stop: (final checkpoint \d+ committed|nothing read since checkpoint \d+)", text
            )
        )
        == 2
    ), text[-3000:]

    # `snapline status`, from Kafka and storage alone: everything committed, lag 0.
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "snapline.pipeline.cli",
            "status",
            "examples.running_total:pipeline",
            "--bootstrap-servers",
            kafka_bootstrap,
            "--checkpoint-dir",
            str(tmp_path / "chk"),
        ],
        cwd=tmp_path,
        env={**env, "COLUMNS": "250"},
        capture_output=True,
        timeout=120,
    )
    out = status.stdout.decode()
    assert status.returncode == 0, status.stderr.decode()
    assert f"total lag: 0 records over {len(tasks)} tasks" in out, out
    for topic in topics:
        for i in range(PARTITIONS):
            assert f"{topic}[{i}]" in out, out
