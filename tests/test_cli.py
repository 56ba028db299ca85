"""The ``snapline`` command without a broker (click's CliRunner): version, help that explains
itself, the checkpoints table, status's error without Kafka, and the ui page's content."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from snapline.pipeline.checkpoint.history import HistoryEntry, HistoryWriter, TaskTimes
from snapline.pipeline.checkpoint.metadata import CheckpointRef, TaskCheckpoint, mark_committed
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.cli import main
from snapline.pipeline.state.backend import StateFile, StateHandle

SPEC = "examples.running_total:build"
JOB = "cli-test-job"


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("SNAPLINE_EXAMPLE_JOB", JOB)
    monkeypatch.setenv("COLUMNS", "200")
    for name in ("SNAPLINE_BOOTSTRAP_SERVERS", "SNAPLINE_CHECKPOINT_DIR"):
        monkeypatch.delenv(name, raising=False)
    return CliRunner()


def _store(root: Path) -> CheckpointStorage:
    storage = CheckpointStorage(str(root))
    for task, n in (("p0", 1), ("p0", 2), ("p1", 2)):
        ref = CheckpointRef(n, "abcd1234")
        TaskCheckpoint(
            job=JOB,
            task_id=task,
            ref=ref,
            worker_id="w0",
            positions={("orders", int(task[1])): 100 * n},
            state=StateHandle("memory", (StateFile(f"{JOB}/x/{task}-{n}", 2048, "crc32:0"),)),
            created_at=time.time(),
            timings={"sync": 0.001, "alignment": 0.002, "async": 0.03},
        ).write(storage)
        if n == 1 or task == "p1":
            mark_committed(storage, JOB, task, ref)
    writer = HistoryWriter(str(root), JOB, "w0")
    writer.record(
        HistoryEntry(
            "checkpoint",
            "w0",
            "completed",
            time.time(),
            1,
            duration=0.2,
            bytes=2048,
            tasks={"p0": TaskTimes(0.001, 0.002, 0.03, 2048, 2048)},
        )
    )
    writer.record(
        HistoryEntry("checkpoint", "w0", "failed", time.time(), 2, reason="No space left")
    )
    writer.close()
    return storage


def test_version(runner: CliRunner) -> None:
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("snapline, version ")


def test_command_summaries_are_not_cut_off(runner: CliRunner) -> None:
    for args in ([], ["savepoint"], ["kafka"], ["spark"]):
        result = runner.invoke(main, [*args, "--help"])
        assert result.exit_code == 0, result.output
        commands = result.output.split("Commands:")[1]
        assert "..." not in commands, commands
    assert "Serve a web page" in runner.invoke(main, ["-h"]).output


def test_run_help_shows_environment_and_defaults(runner: CliRunner) -> None:
    text = " ".join(runner.invoke(main, ["run", "--help"]).output.split())
    for expected in (
        "env var: SNAPLINE_BOOTSTRAP_SERVERS",
        "default: (an embedded local broker)",
        "env var: SNAPLINE_CHECKPOINT_DIR",
        ".snapline/checkpoints",
        "SNAPLINE_METRICS_PORT",
        "PORT+i",
        "[debug|info|warning|error|critical]",
    ):
        assert expected in text, expected


def test_log_level_lists_its_choices(runner: CliRunner) -> None:
    result = runner.invoke(main, ["run", SPEC, "--log-level", "loud"])
    assert result.exit_code == 2
    assert "'loud' is not one of" in result.output and "warning" in result.output


def test_checkpoints_table_has_headers_and_states(runner: CliRunner, tmp_path: Path) -> None:
    _store(tmp_path / "chk")
    result = runner.invoke(main, ["checkpoints", SPEC, "--checkpoint-dir", str(tmp_path / "chk")])
    assert result.exit_code == 0, result.output
    for header in ("task", "id", "attempt", "state", "size", "sync ms", "positions"):
        assert header in result.output
    assert result.output.count("committed") == 2 and "complete " in result.output
    assert "orders[0]=200" in result.output and "2.0 KiB" in result.output
    explained = runner.invoke(main, ["checkpoints", "--help"]).output
    assert "INCOMPLETE" in explained and "barrier positions" in explained


def test_checkpoints_of_an_empty_store(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["checkpoints", SPEC, "--checkpoint-dir", str(tmp_path)])
    assert result.exit_code == 0 and "no checkpoints of job" in result.output


def test_status_needs_kafka_and_says_how(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(main, ["status", SPEC, "--checkpoint-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "--bootstrap-servers" in result.output and "SNAPLINE_BOOTSTRAP_SERVERS" in result.output


def test_ui_page_and_json_from_storage(runner: CliRunner, tmp_path: Path) -> None:
    from snapline.pipeline.graph import load_pipeline
    from snapline.pipeline.ui.server import UIServer
    from snapline.pipeline.ui.view import ViewSource

    storage = _store(tmp_path / "chk")
    server = UIServer(ViewSource(load_pipeline(SPEC), storage), port=0)
    server.start()
    try:
        with urllib.request.urlopen(server.url + "?refresh=0", timeout=10) as response:
            page = response.read().decode()
        with urllib.request.urlopen(server.url + "api/job.json", timeout=10) as response:
            data = json.loads(response.read())
    finally:
        server.close()
    assert page.count('class="history-row"') == 2 and "No space left" in page
    assert page.count('class="retained-row"') == 3 and 'http-equiv="refresh"' not in page
    assert [t["task"] for t in data["tasks"]] == ["p0", "p1"]
    assert [(h["status"], h["checkpoint_id"]) for h in data["history"]] == [
        ("failed", 2),
        ("completed", 1),
    ]
    p0 = data["tasks"][0]["checkpoints"]
    assert [(c["id"], c["committed"]) for c in p0] == [(1, True), (2, False)]


def test_progress_bar_completes_every_step() -> None:
    import io

    from rich.console import Console

    from snapline.pipeline.progress import progress_bar

    out = io.StringIO()
    with progress_bar(Console(file=out, width=100)) as bar:
        for done in range(3):  # export reports before each task: never 4/4 by itself
            bar(f"state ({done * 10} rows, 0.1 MB)", done, 4)
        bar("in flight: orders.repartition", 0, 1)
    text = out.getvalue()
    assert "4/4 tasks" in text and "1/1 tasks" in text and "state (20 rows, 0.1 MB)" in text
    assert text.count("state (") == 1


@pytest.mark.parametrize("code", [75, 78])
def test_a_click_error_exits_with_its_code_and_a_redacted_message(code: int) -> None:
    """Configuration errors exit 78 and a broker that stays away 75 (the supervisor's rules);
    click 8.5 made ``exit_code`` a class variable and ``message`` final, which an assignment
    on the instance no longer type-checks against."""
    from snapline.pipeline.cli_help import FullSummaryGroup, click_error

    @click.group(cls=FullSummaryGroup)
    def group() -> None:
        pass

    @group.command()
    def fail() -> None:
        raise click_error("cannot reach kafka://user:hunter2@broker:9092", code)

    result = CliRunner().invoke(group, ["fail"])
    assert result.exit_code == code
    assert "cannot reach" in result.output and "hunter2" not in result.output
