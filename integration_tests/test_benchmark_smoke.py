"""The benchmark harness runs end to end in CI (``--quick``): every system produces correct
output on the shared broker. No performance thresholds: numbers on a shared 2-core machine
are compared as ratios within one run, in benchmarks/README.md, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parent.parent


def test_benchmark_harness_quick_run(kafka_bootstrap: str, tmp_path: Path) -> None:
    output = tmp_path / "quick.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "run",
            "--quick",
            "--bootstrap-servers",
            kafka_bootstrap,
            "--output",
            str(output),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert output.exists()
    text = json.dumps(json.loads(output.read_text()))
    assert "FAILED" not in text
