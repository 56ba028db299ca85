"""The supervisor on a real broker (issue 9, item 6): a configuration error at start is not
retried; the job exits at once with EX_CONFIG and the message, printed once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapline.pipeline.supervisor import EX_CONFIG

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
#: Two worker starts (imports, broker metadata) and one stop; far below the old behaviour
#: (11 restarts in 14 s, then "giving up").
EXIT_BOUND = 45.0


def test_configuration_error_stops_the_job_at_once(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "snapline.pipeline.cli",
            "run",
            "integration_tests.pipelines:missing_topic",  # its source topic does not exist
            "--workers",
            "2",
            "--worker-id",
            "sup",
            "--bootstrap-servers",
            kafka_bootstrap,
            "--checkpoint-dir",
            str(tmp_path / "chk"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "SNAPLINE_TEST_PREFIX": prefix, "PYTHONPATH": str(REPO)},
    )
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == EX_CONFIG, output[-3000:]
    assert elapsed < EXIT_BOUND, output[-3000:]
    # each worker started exactly once: nothing was restarted
    assert output.count("started worker sup-0 ") == 1, output[-3000:]
    assert output.count("started worker sup-1 ") == 1, output[-3000:]
    assert "restarting in" not in output and "giving up" not in output, output[-3000:]
    # the message names the topic and the fix, once
    missing = f"{prefix}no-such-topic"
    assert output.count("do not exist") == 1, output[-3000:]
    error_lines = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert len(error_lines) == 1 and missing in error_lines[0], output[-3000:]
    assert "create_partitions" in error_lines[0]
