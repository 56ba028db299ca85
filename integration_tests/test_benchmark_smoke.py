"""The benchmark harness runs end to end in CI (``--quick``): every system produces correct
output on the shared broker, in the keyed suite and in the stages suite (input keyed by order
id, 2-stage running total). Latency runs share their code across systems (the rate producer,
the verifier, the system's start): CI runs them for one system of each kind (the baseline,
Snapline exactly-once and at-least-once), which saves a minute of fixed start-up costs. No
performance thresholds: numbers on a shared 2-core machine are compared as ratios within one
run, in benchmarks/README.md, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.suite import SUITES
from examples.workers import child_pythonpath

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent
LATENCY_SYSTEMS = ("baseline-a", "snapline-memory", "snapline-memory-alo")
KEYED_SYSTEMS = {s.name for s in SUITES["keyed"].systems}


def test_benchmark_harness_quick_run(kafka_bootstrap: str, tmp_path: Path) -> None:
    output = tmp_path / "quick.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "run",
            "--quick",
            # smaller than --quick's 50k: each of the 11 systems' runs is a smoke test here
            "--records",
            "20000",
            "--keys",
            "500",
            "--latency-only",
            ",".join(LATENCY_SYSTEMS),
            "--bootstrap-servers",
            kafka_bootstrap,
            "--output",
            str(output),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
    )
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert output.exists()
    payload = json.loads(output.read_text())
    assert "FAILED" not in json.dumps(payload)
    runs = {(r["system"], r["kind"]) for r in payload["runs"] if r["status"] == "ok"}
    assert {s for s, kind in runs if kind == "latency"} == set(LATENCY_SYSTEMS)
    assert {s for s, kind in runs if kind == "throughput"} == set(KEYED_SYSTEMS)


def test_benchmark_stages_suite_quick_run(kafka_bootstrap: str, tmp_path: Path) -> None:
    """The stages suite's code path (order-keyed input, Quix group_by, Snapline's repartition
    stage, the order-free verifier) on a small input, throughput runs only, to stay well under
    a minute; the latency runs' code is the keyed suite's, exercised above."""
    output = tmp_path / "stages.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "run",
            "--suite",
            "stages",
            "--quick",
            "--records",
            "10000",
            "--keys",
            "200",
            "--no-latency",
            "--bootstrap-servers",
            kafka_bootstrap,
            "--output",
            str(output),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
    )
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    payload = json.loads(output.read_text())
    assert "FAILED" not in json.dumps(payload)
    runs = {(r["system"], r["kind"]) for r in payload["runs"] if r["status"] == "ok"}
    systems = (
        "baseline-a",
        "quix-group-by",
        "snapline-2stage-memory",
        "snapline-2stage-memory-2w",
        "snapline-2stage-rocksdb",
    )
    assert runs == {(s, "throughput") for s in systems}
