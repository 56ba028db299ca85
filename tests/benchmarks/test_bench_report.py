"""Summaries, ratios, tables and the small contracts of the benchmark harness."""

from __future__ import annotations

from pathlib import Path

from benchmarks.child_env import ChildEnv, StartMarker, read_start_time
from benchmarks.harness import RunResult
from benchmarks.report import (
    Machine,
    markdown_table,
    summarize_systems,
    update_readme,
)
from benchmarks.snapline_runs import checkpoint_metrics
from benchmarks.stats import percentile
from benchmarks.suite import ALL_SYSTEMS, select
from benchmarks.systems import BASELINE_A, QUIX


def run(system: str, rate: float | None, status: str = "ok") -> RunResult:
    return RunResult(
        system=system,
        kind="throughput",
        repetition=1,
        status=status,
        records_per_s=rate,
        peak_rss_mb=100.0,
        problems=[] if status == "ok" else ["wrong output: 3 outputs for 2"],
    )


def test_ratios_use_medians_and_failed_runs_have_no_number() -> None:
    results = [
        run("baseline-a", 100.0),
        run("baseline-a", 120.0),
        run("baseline-a", 110.0),
        run("quix", 20.0),
        run("quix", 30.0, status="FAILED"),
    ]
    rows = {r["system"]: r for r in summarize_systems([BASELINE_A, QUIX], results)}
    assert rows["baseline-a"]["records_per_s"] == 110.0
    assert rows["baseline-a"]["vs_baseline_a"] == 1.0
    assert rows["quix"]["status"] == "FAILED"
    assert rows["quix"]["records_per_s"] is None
    assert rows["baseline-a"]["vs_peer"] is None
    table = markdown_table(list(rows.values()))
    assert "| quix | exactly-once | FAILED |" in table


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([], 50) is None


def test_update_readme_replaces_only_the_table(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    begin, end = "<!-- results-table:begin -->", "<!-- results-table:end -->"
    other = "<!-- recovery-table:begin -->\nkeep\n<!-- recovery-table:end -->"
    readme.write_text(f"intro\n{begin}\nold\n{end}\n{other}\noutro\n")
    update_readme("| new |", readme)
    assert readme.read_text() == f"intro\n{begin}\n| new |\n{end}\n{other}\noutro\n"


def test_machine_short_name() -> None:
    m = Machine("Intel(R) Xeon(R) Processor @ 3.80GHz", 2, 23.5, "3.11.7")
    assert m.short == "xeon-3.80ghz-2c-24gb"


def test_child_env_round_trip_and_start_marker(tmp_path: Path) -> None:
    env = ChildEnv(
        "b:1",
        "in",
        "out",
        "g",
        str(tmp_path / "s"),
        str(tmp_path / "st"),
        str(tmp_path / "state"),
        0.5,
        "rocksdb",
        "at_least_once",
    )
    assert ChildEnv.from_environ(env.to_environ()) == env
    assert read_start_time(env.start_file) is None
    first, second = StartMarker(env.start_file), StartMarker(env.start_file)
    first.mark()
    written = read_start_time(env.start_file)
    second.mark()
    assert written is not None and read_start_time(env.start_file) == written


def test_checkpoint_metrics(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(
        '{"event": "checkpoint", "commit_ms": 5.0, "total_ms": 40.0, '
        '"state_bytes": 10}\nnot json\n{"event": "checkpoint_failed"}\n'
    )
    metrics = checkpoint_metrics(path)
    assert metrics["commit"] == [0.005] and metrics["checkpoint"] == [0.04]
    assert metrics["failed"] == [1.0]
    assert checkpoint_metrics(tmp_path / "missing")["commit"] == []


def test_system_selection() -> None:
    assert [s.name for s in select(("quix", "baseline-a"))] == ["baseline-a", "quix"]
    assert len(select(())) == len(ALL_SYSTEMS)
    try:
        select(("nope",))
    except ValueError as exc:
        assert "nope" in str(exc)
    else:
        raise AssertionError("unknown system accepted")


def test_stages_suite_compares_the_two_stage_total_with_baseline_a_and_quix_group_by() -> None:
    names = [s.name for s in select((), "stages")]
    assert names == [
        "baseline-a",
        "quix-group-by",
        "snapline-2stage-memory",
        "snapline-2stage-memory-2w",
        "snapline-2stage-rocksdb",
    ]
    assert [s.name for s in select(()) if s.role == "peer"] == ["quix"]
    assert [s.name for s in select((), "stages") if s.role == "peer"] == ["quix-group-by"]
    try:
        select(("snapline-memory",), "stages")  # one stage cannot total order-keyed input
    except ValueError as exc:
        assert "stages" in str(exc)
    else:
        raise AssertionError("a keyed-suite system accepted in the stages suite")
