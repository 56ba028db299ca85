"""Worker metrics without a broker: stage labels, the Prometheus series a checkpoint and a
restore produce, the checkpoint history they write, the supervisor's metrics ports and the
address the endpoint binds."""

from __future__ import annotations

import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from snapline.pipeline.checkpoint.history import read_history
from snapline.pipeline.checkpoint.metadata import CheckpointRef, TaskCheckpoint
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.runtime.coordinator import CompletedCheckpoint, PendingCheckpoint
from snapline.pipeline.runtime.metrics import DEFAULT_METRICS_HOST, WorkerMetrics, stage_of
from snapline.pipeline.runtime.task import Task
from snapline.pipeline.state.backend import StateFile, StateHandle
from snapline.pipeline.supervisor import Supervisor


def test_stage_label_is_the_digit_after_s() -> None:
    assert stage_of("p3") == "0"
    assert stage_of("s1-p3") == "1"
    assert stage_of("s12-p0") == "12"


def _done(n: int, files: tuple[StateFile, ...]) -> CompletedCheckpoint:
    now = time.monotonic()
    meta = TaskCheckpoint(
        job="orders",
        task_id="s1-p0",
        ref=CheckpointRef(n, "abc"),
        worker_id="w0",
        positions={("orders", 0): 10 * n},
        state=StateHandle("memory", files),
        timings={"sync": 0.002, "alignment": 0.01, "async": 0.05},
        triggered_at=time.time() - 0.2,
    )
    return CompletedCheckpoint(n, {"s1-p0": meta}, now - 0.2, now - 0.15, now - 0.05, time.time())


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((dict(s.labels), s.value))
    return found


def test_a_restored_task_reports_the_checkpoint_it_restored_as_its_last(tmp_path: Path) -> None:
    """A task that moved here has a last committed checkpoint before this worker commits one:
    the one it restored (a task restored without a checkpoint has no such series)."""
    metrics = WorkerMetrics("orders", "w1", str(tmp_path), port=0, addr="127.0.0.1")
    try:
        assert metrics.port
        metrics.on_event(
            {
                "event": "restored",
                "seconds": 0.1,
                "checkpoints": {"p0": 7, "p1": None},
                "bytes": {"p0": 10},
            },
            None,
        )
        found = _scrape(metrics.port)
    finally:
        metrics.close()
    assert found["snapline_last_checkpoint_id"] == [
        ({"job": "orders", "worker": "w1", "stage": "0", "task": "p0"}, 7.0)
    ]


def test_checkpoints_and_restores_become_series_and_history(tmp_path: Path) -> None:
    metrics = WorkerMetrics("orders", "w0", str(tmp_path), port=0, addr="127.0.0.1")
    try:
        assert metrics.port
        a, b = StateFile("orders/shared/a", 100, "crc32:0"), StateFile("orders/shared/b", 30, "x")
        metrics.checkpoint_completed(_done(1, (a,)), 0.01)
        metrics.checkpoint_completed(_done(2, (a, b)), 0.02)
        pending = PendingCheckpoint(3, {"s1-p0"}, time.monotonic() - 1.0)
        metrics.on_event({"event": "checkpoint_failed", "error": "disk full"}, pending)
        metrics.on_event(
            {
                "event": "restored",
                "seconds": 0.5,
                "checkpoints": {"s1-p0": 2},
                "bytes": {"s1-p0": 130},
            },
            None,
        )
        found = _scrape(metrics.port)
    finally:
        metrics.close()
    task = {"job": "orders", "worker": "w0", "stage": "1", "task": "s1-p0"}
    sizes = {s[0]["kind"]: s[1] for s in found["snapline_checkpoint_size_bytes"]}
    assert sizes == {"full": 130, "incremental": 30}
    assert found["snapline_checkpoint_uploaded_bytes_total"] == [(task, 130.0)]
    statuses = {s[0]["status"]: s[1] for s in found["snapline_checkpoints_total"]}
    assert statuses == {"completed": 2, "failed": 1}
    assert found["snapline_last_checkpoint_id"] == [(task, 2.0)]
    assert found["snapline_restored_bytes_total"] == [(task, 130.0)]
    phases = {s[0]["phase"] for s in found["snapline_task_checkpoint_duration_seconds_count"]}
    assert phases == {"sync", "alignment", "async"}

    history = read_history(CheckpointStorage(str(tmp_path)), "orders")
    assert [(e.kind, e.status, e.checkpoint_id) for e in history] == [
        ("restore", "restored", 2),
        ("checkpoint", "failed", 3),
        ("checkpoint", "completed", 2),
        ("checkpoint", "completed", 1),
    ]
    assert history[1].reason == "disk full"
    assert history[2].tasks["s1-p0"].incremental_bytes == 30
    assert history[2].tasks["s1-p0"].sync == 0.002


def _task(dead_letters: int, late_dropped: int) -> Any:
    """What ``count`` reads of a task."""
    return SimpleNamespace(
        records_in=10, sink_writers={}, dead_letters=dead_letters, late_dropped=late_dropped
    )


def test_dead_letters_and_late_records_dropped_are_counted_per_task(tmp_path: Path) -> None:
    """Late records a window dropped (on_late="drop") were counted where nothing read them;
    they are a counter next to the dead letters, which keeps growing when the worker replaces
    the task (a restore: the new task counts from 0)."""
    metrics = WorkerMetrics("orders", "w0", str(tmp_path), port=0, addr="127.0.0.1")
    try:
        assert metrics.port
        task = _task(dead_letters=1, late_dropped=3)
        metrics.count(cast(dict[str, Task], {"s1-p0": task}))
        task.late_dropped, task.dead_letters = 5, 2
        metrics.count(cast(dict[str, Task], {"s1-p0": task}))
        metrics.count(cast(dict[str, Task], {"s1-p0": _task(dead_letters=0, late_dropped=1)}))
        found = _scrape(metrics.port)
    finally:
        metrics.close()
    task_labels = {"job": "orders", "worker": "w0", "stage": "1", "task": "s1-p0"}
    assert found["snapline_late_records_dropped_total"] == [(task_labels, 6.0)]
    assert found["snapline_dead_letters_total"] == [(task_labels, 2.0)]


def test_history_is_written_without_a_metrics_port(tmp_path: Path) -> None:
    metrics = WorkerMetrics("orders", "w/0", str(tmp_path))
    metrics.checkpoint_completed(_done(1, ()), 0.01)
    metrics.close()
    (entry,) = read_history(CheckpointStorage(str(tmp_path)), "orders")
    assert (entry.worker, entry.checkpoint_id) == ("w/0", 1)


def test_supervised_workers_get_consecutive_metrics_ports() -> None:
    supervisor = Supervisor("m:p", ["w-0", "w-1"], [], metrics_port=9400)
    commands = [supervisor._command(w) for w in ("w-0", "w-1")]
    assert [c[c.index("--metrics-port") + 1] for c in commands] == ["9400", "9401"]
    any_port = Supervisor("m:p", ["w-0", "w-1"], [], metrics_port=0)
    assert any_port._command("w-1")[-1] == "0"
    assert "--metrics-port" not in Supervisor("m:p", ["w-0"], [])._command("w-0")


def test_incremental_bytes_after_a_restore_count_only_new_files(tmp_path: Path) -> None:
    a, b = StateFile("orders/shared/a", 100, "x"), StateFile("orders/shared/b", 30, "x")
    metrics = WorkerMetrics("orders", "w0", str(tmp_path))
    metrics.restored_files("s1-p0", StateHandle("rocksdb", (a,)))
    metrics.on_event(
        {"event": "restored", "seconds": 0.1, "checkpoints": {"s1-p0": 1}, "bytes": {"s1-p0": 100}},
        None,
    )
    metrics.checkpoint_completed(_done(2, (a, b)), 0.01)
    metrics.close()
    latest = read_history(CheckpointStorage(str(tmp_path)), "orders")[0]
    assert (latest.bytes, latest.incremental_bytes) == (130, 30)


def test_a_taken_metrics_port_is_a_configuration_error(tmp_path: Path) -> None:
    import socket

    from snapline.pipeline.errors import ConfigurationError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match="--metrics-port"):
            WorkerMetrics("orders", "w0", str(tmp_path), port=port, addr="127.0.0.1")


def test_the_endpoint_binds_the_metrics_host(tmp_path: Path) -> None:
    local = WorkerMetrics("orders", "w0", str(tmp_path / "a"), port=0, addr="127.0.0.1")
    everywhere = WorkerMetrics("orders", "w1", str(tmp_path / "b"), port=0)
    try:
        assert local._server.server_address[0] == "127.0.0.1"
        assert local.port
        _scrape(local.port)  # served on the loopback address
        assert everywhere._server.server_address[0] == DEFAULT_METRICS_HOST == "0.0.0.0"
    finally:
        local.close()
        everywhere.close()


class _Stop(Exception):
    pass


def test_metrics_host_reaches_the_worker_and_supervised_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--metrics-host (or SNAPLINE_METRICS_HOST) -> WorkerSettings -> WorkerMetrics' address;
    with --workers N, every worker's command line."""
    import snapline.pipeline.runtime.worker as worker_module
    from snapline.pipeline.cli import main
    from snapline.pipeline.graph import load_pipeline

    for name in ("SNAPLINE_METRICS_HOST", "SNAPLINE_CHECKPOINT_DIR", "SNAPLINE_WORKER_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # `run` puts the working directory first
    settings: list[worker_module.WorkerSettings] = []
    monkeypatch.setattr(worker_module, "run_worker", lambda _p, s: settings.append(s))
    commands: list[list[str]] = []

    def supervise(self: Supervisor) -> int:
        commands.append(self._command(self.worker_ids[-1]))
        return 0

    monkeypatch.setattr(Supervisor, "run", supervise)
    run = ["run", "examples.running_total:build", "--bootstrap-servers", "k:9092"]
    run += ["--checkpoint-dir", str(tmp_path), "--metrics-port", "0"]
    runner = CliRunner()
    assert runner.invoke(main, [*run, "--metrics-host", "127.0.0.1"]).exit_code == 0
    assert runner.invoke(main, run, env={"SNAPLINE_METRICS_HOST": "::1"}).exit_code == 0
    assert runner.invoke(main, run).exit_code == 0
    assert [s.metrics_host for s in settings] == ["127.0.0.1", "::1", "0.0.0.0"]
    supervised = runner.invoke(main, [*run, "--workers", "2", "--metrics-host", "127.0.0.1"])
    assert supervised.exit_code == 0
    assert commands[0][commands[0].index("--metrics-host") + 1] == "127.0.0.1"

    addresses: list[str] = []

    def metrics(job: str, worker: str, directory: str, port: int | None, addr: str = "?") -> None:
        addresses.append(addr)
        raise _Stop

    monkeypatch.setattr(worker_module, "WorkerMetrics", metrics)
    with pytest.raises(_Stop):
        worker_module.Worker(load_pipeline("examples.running_total:build"), settings[0])
    assert addresses == ["127.0.0.1"]
