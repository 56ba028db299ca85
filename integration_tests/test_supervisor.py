"""The supervisor on a real broker: a configuration error at start is not retried (the job
exits at once with EX_CONFIG and the message, printed once; issue 9, item 6), and a killed
supervisor leaves no worker behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from examples.workers import child_pythonpath, process_gone, read_events
from integration_tests.warehouse_job import SPEC, WarehouseJob, wait_for
from snapline.pipeline.runtime.worker import STOP_BOUND
from snapline.pipeline.supervisor import EX_CONFIG

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
#: Two worker starts (imports, broker metadata) and one stop; far below the old behaviour
#: (11 restarts in 14 s, then "giving up").
EXIT_BOUND = 45.0


def _two_workers(spec: str, bootstrap: str, checkpoint_dir: Path) -> list[str]:
    """``snapline run`` of ``spec`` as a supervisor of workers sup-0 and sup-1."""
    return [
        sys.executable,
        "-m",
        "snapline.pipeline.cli",
        "run",
        spec,
        "--workers",
        "2",
        "--worker-id",
        "sup",
        "--bootstrap-servers",
        bootstrap,
        "--checkpoint-dir",
        str(checkpoint_dir),
    ]


def test_configuration_error_stops_the_job_at_once(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    started = time.monotonic()
    result = subprocess.run(
        # its source topic does not exist
        _two_workers(
            "integration_tests.pipelines:missing_topic", kafka_bootstrap, tmp_path / "chk"
        ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "SNAPLINE_TEST_PREFIX": prefix, "PYTHONPATH": child_pythonpath()},
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


def test_a_killed_supervisor_leaves_no_worker_behind_and_its_successor_runs_the_job(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, postgres_dsn: str, jobs: list[Any]
) -> None:
    """SIGKILL of the supervisor (the OOM killer, a service manager's last resort) used to
    leave its workers running as orphans; the next supervisor's workers of the same ids then
    met them: fenced by them in Kafka, their local directories locked. Now each worker gets
    SIGTERM when its supervisor dies, takes its final checkpoint and exits."""
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=4,
        workers=0,
        backend="rocksdb",
    )
    jobs.append(job)
    metrics = tmp_path / "metrics.jsonl"

    def supervisor(run: int) -> subprocess.Popen[bytes]:
        with open(tmp_path / f"supervisor-{run}.log", "wb") as log:
            return subprocess.Popen(
                _two_workers(SPEC, kafka_bootstrap, job.checkpoint_dir),
                cwd=tmp_path,
                env={
                    **os.environ,
                    **job.env,
                    "PYTHONPATH": child_pythonpath(),
                    "SNAPLINE_METRICS_FILE": str(metrics),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def logs() -> str:
        return "\n".join(
            p.read_text(errors="replace")[-3000:] for p in sorted(tmp_path.glob("supervisor-*.log"))
        )

    first = supervisor(1)
    pids: dict[str, int] = {}
    try:
        job.produce(400)
        job.wait_until_caught_up()
        pids = {e["worker"]: e["pid"] for e in read_events(metrics) if e["event"] == "started"}
        assert set(pids) == {"sup-0", "sup-1"}, logs()
        assert not any(process_gone(pid) for pid in pids.values()), logs()  # alive until now
        for pid in pids.values():  # a checkpoint URI can hold credentials: not in ps's output
            command_line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            assert str(job.checkpoint_dir).encode() not in command_line, command_line
        first.kill()
        first.wait(30)
        wait_for(
            "the orphaned workers exiting",
            lambda: all(process_gone(pid) for pid in pids.values()),
            STOP_BOUND + 15,
            logs,
        )
    finally:
        first.kill()
        for pid in pids.values():  # orphans, if the test failed: not left running
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
    second = supervisor(2)
    try:
        job.produce(400)
        job.wait_until_caught_up()
        second.send_signal(signal.SIGTERM)
        assert second.wait(STOP_BOUND + 15) == 0, logs()
    finally:
        second.kill()
    job.verify()
    assert "is already running on this host" not in logs()
