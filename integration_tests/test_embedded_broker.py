"""The embedded broker of ``snapline run`` behaves like a deployment across restarts (issue 9,
item 5): a job run, stopped with SIGTERM and run again without ``--bootstrap-servers`` meets
the same broker (same address, same cluster id, its topics and committed offsets), restores
its committed checkpoints and continues without re-processing the first run's input."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from examples.orders import produce_orders, read_committed, verify_totals
from examples.workers import child_pythonpath

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
#: Starting the broker (JVM, KRaft) and a worker on a loaded 2-core machine.
START_BOUND = 180.0
ADDRESS = re.compile(r"embedded Kafka broker at (127\.0\.0\.1:\d+)")
RESTORED = re.compile(r"task (\S+) restored from (checkpoint (\d+)|no checkpoint)")


def _start(tmp_path: Path, log: Path, prefix: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_SETTINGS}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "snapline.pipeline.cli",
            "run",
            "integration_tests.pipelines:embedded_total",
            "--worker-id",
            "emb",
        ],
        cwd=tmp_path,
        env={**env, "SNAPLINE_TEST_PREFIX": prefix, "PYTHONPATH": child_pythonpath()},
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )


# The run must choose its own broker and checkpoint dir, whatever the session uses.
_CLUSTER_SETTINGS = ("SNAPLINE_BOOTSTRAP_SERVERS", "SNAPLINE_CHECKPOINT_DIR")


def _wait_for(pattern: re.Pattern[str], log: Path, proc: subprocess.Popen[bytes]) -> re.Match:
    deadline = time.monotonic() + START_BOUND
    while time.monotonic() < deadline:
        match = pattern.search(log.read_text(errors="replace"))
        if match:
            return match
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {pattern.pattern!r} within {START_BOUND} s in {log}")


def _wait_for_topics(bootstrap: str, topics: list[str]) -> None:
    """The worker creates its source and sink topics at start; wait until they have leaders."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + START_BOUND
    while time.monotonic() < deadline:
        metadata = admin.list_topics(timeout=10).topics
        if all(
            t in metadata
            and metadata[t].partitions
            and all(p.leader >= 0 for p in metadata[t].partitions.values())
            for t in topics
        ):
            return
        time.sleep(0.5)
    raise AssertionError(f"topics {topics} not created within {START_BOUND} s")


def _cluster_id(bootstrap: str) -> str:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    return str(admin.describe_cluster(request_timeout=30).result(timeout=60).cluster_id)


def _stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
        raise AssertionError(
            "snapline run ignored SIGTERM for 90 s\n" + log.read_text(errors="replace")[-3000:]
        ) from None
    assert code == 0, log.read_text(errors="replace")[-3000:]


def test_second_run_continues_on_the_same_embedded_broker(tmp_path: Path, unique_name: str) -> None:
    prefix = f"{unique_name}-"
    orders, totals = f"{prefix}orders", f"{prefix}totals"
    first, second = 3000, 3000
    log1, log2 = tmp_path / "run1.log", tmp_path / "run2.log"
    idempotent = {"enable.idempotence": True}

    run1 = _start(tmp_path, log1, prefix)
    try:
        address = _wait_for(ADDRESS, log1, run1).group(1)
        assert "(new; data " in log1.read_text(errors="replace")
        _wait_for_topics(address, [orders, totals])
        cluster = _cluster_id(address)
        expected = Counter(produce_orders(address, orders, first, 40, producer_config=idempotent))
        outputs = read_committed(address, totals, first, timeout=120, settle=1)
        assert len(outputs) == first
    finally:
        _stop(run1, log1)
    data_dir = tmp_path / ".snapline" / "kafka"
    assert (data_dir / "kraft-logs" / "meta.properties").exists()
    tasks = tmp_path / ".snapline" / "checkpoints" / f"{prefix}job" / "tasks"
    kept = {p.relative_to(tasks).as_posix() for p in tasks.glob("*/chk-*")}
    assert kept, f"run 1 left no checkpoint in {tasks}"

    run2 = _start(tmp_path, log2, prefix)
    try:
        restarted = _wait_for(ADDRESS, log2, run2).group(1)
        assert restarted == address
        assert "(restarted on its kept data; data " in log2.read_text(errors="replace")
        assert _cluster_id(address) == cluster
        _wait_for(RESTORED, log2, run2)
        expected.update(
            produce_orders(address, orders, second, 40, start_id=first, producer_config=idempotent)
        )
        outputs = read_committed(address, totals, first + second, timeout=120, settle=2)
    finally:
        _stop(run2, log2)
    text = log2.read_text(errors="replace")
    restored = list(RESTORED.finditer(text))
    assert restored, text[-3000:]
    for match in restored:
        # every task restored the checkpoint run 1 committed, and its files were still there
        assert match.group(3) is not None, f"task {match.group(1)} restored no checkpoint"
        task, checkpoint = match.group(1), int(match.group(3))
        assert any(k.startswith(f"{task}/chk-{checkpoint:010d}-") for k in kept), (task, kept)
    result = verify_totals(outputs, dict(expected), range(first + second))
    assert result.ok, result.summary()
