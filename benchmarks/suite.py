"""``python -m benchmarks run``: prepare the input once, then measure every selected system,
repetitions interleaved, and publish a summary with ratios measured in this one run."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks import report
from benchmarks.harness import Bench, RunResult, Settings
from benchmarks.kafka_admin import Topics
from benchmarks.snapline_runs import SNAPLINE_STAGE_SYSTEMS, SNAPLINE_SYSTEMS, runtime_missing
from benchmarks.systems import BASELINE_A, BASELINE_B, QUIX, QUIX_GROUP_BY, System
from benchmarks.workload import RECORD_BYTES, KeyedBy, generate, prepare_input


@dataclass(frozen=True)
class Suite:
    """A set of systems measured on one input: how that input is keyed, where results go."""

    name: str
    systems: tuple[System, ...]
    keyed_by: KeyedBy
    readme_marker: str  # the README section its full runs replace
    results_suffix: str  # added to the results file name


SUITES: dict[str, Suite] = {
    # Input keyed by customer: the running total needs no repartition (one stage).
    "keyed": Suite("keyed", (BASELINE_A, BASELINE_B, QUIX, *SNAPLINE_SYSTEMS), "customer",
                   "results-table", ""),
    # Input keyed by order id: the running total per customer re-keys (two stages).
    "stages": Suite("stages", (BASELINE_A, QUIX_GROUP_BY, *SNAPLINE_STAGE_SYSTEMS), "order",
                    "stages-table", "-stages"),
}
ALL_SYSTEMS: tuple[System, ...] = SUITES["keyed"].systems


@dataclass(frozen=True)
class SuiteConfig:
    records: int
    keys: int
    repetitions: int
    partitions: int
    quick: bool
    only: tuple[str, ...]
    profile: bool
    latency: bool
    latency_rate: float
    latency_seconds: float
    output: Path | None
    command: str
    keep_workdir: bool = False
    time_budget: float | None = None  # seconds; later runs are SKIPPED once it is used up
    suite: str = "keyed"
    #: Systems that get a latency run (empty: every selected system).
    latency_only: tuple[str, ...] = ()


def select(only: tuple[str, ...], suite: str = "keyed") -> list[System]:
    systems = SUITES[suite].systems
    if not only:
        return list(systems)
    names = {s.name for s in systems}
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown} in suite {suite!r}; choose from "
                         f"{sorted(names)}")
    return [s for s in systems if s.name in only]


def _line(result: RunResult) -> str:
    if result.status != "ok":
        return f"{result.status}: {'; '.join(result.problems)}"
    if result.kind == "latency":
        lat = result.latency_s
        return (f"latency p50 {lat.get('p50', 0) * 1000:,.0f} ms, "
                f"p99 {lat.get('p99', 0) * 1000:,.0f} ms over {lat.get('count')} records")
    cpu = ""
    if result.cpu_s is not None and result.machine_busy_cores is not None:
        per = 1e6 / result.records
        split = "/".join(f"{v * per:.1f}" for v in result.cpu_threads_s.values())
        cpu = (f", CPU {result.cpu_s * per:.1f} µs/record (main/librdkafka/other threads "
               f"{split}), machine {result.machine_busy_cores:.2f} cores busy")
        if result.machine_steal_cores:
            cpu += f" ({result.machine_steal_cores:.2f} stolen by the hypervisor)"
        if result.main_wait_s is not None and result.elapsed_s:
            cpu += (f", main threads waited for a CPU "
                    f"{result.main_wait_s / result.elapsed_s:.0%} of the run")
    return (f"{result.records_per_s:,.0f} records/s ({result.elapsed_s:.1f}s, startup "
            f"{result.startup_s:.1f}s, peak RSS {result.peak_rss_mb:,.0f} MB{cpu})")


def run_suite(config: SuiteConfig, bootstrap: str, console: Console) -> dict[str, Any]:
    suite = SUITES[config.suite]
    systems = select(config.only, config.suite)
    missing = runtime_missing()
    prefix = f"bench-{datetime.now(UTC):%m%d%H%M%S}-{secrets.token_hex(2)}"
    workdir = Path(tempfile.mkdtemp(prefix="snapline-bench-"))
    profile_dir = report.RESULTS_DIR / "tmp" / "profiles" / prefix if config.profile else None
    settings = Settings(
        partitions=config.partitions,
        latency_rate=config.latency_rate,
        latency_seconds=config.latency_seconds,
        latency_keys=min(config.keys, 1000),
        startup_timeout=60.0 if config.quick else 120.0,
        stall_timeout=30.0 if config.quick else 60.0,
        profile_dir=profile_dir,
        keyed_by=suite.keyed_by,
    )
    topics = Topics(bootstrap)
    bench = Bench(bootstrap, topics, prefix, workdir, settings)
    results: list[RunResult] = []
    m = report.machine()
    console.print(f"[bold]machine[/bold]: {m.description}")
    console.print(f"[bold]broker[/bold]: {bootstrap}   [bold]work dir[/bold]: {workdir}")
    started = time.monotonic()

    def over_budget(system: System, kind: str, rep: int) -> bool:
        if config.time_budget is None or time.monotonic() - started < config.time_budget:
            return False
        results.append(RunResult(system.name, kind, rep, status="SKIPPED",
                                 problems=[f"time budget of {config.time_budget:.0f}s used up"]))
        console.print(f"[yellow]{system.name}[/yellow] {kind}: SKIPPED (time budget)")
        return True

    try:
        in_topic = topics.create(f"{prefix}-in", config.partitions)
        t0 = time.monotonic()
        expected = prepare_input(bootstrap, in_topic, generate(config.records, config.keys),
                                 keyed_by=suite.keyed_by)
        console.print(f"input: {config.records:,} records of {RECORD_BYTES} B, "
                      f"{len(expected.totals):,} customers, keyed by {suite.keyed_by}, "
                      f"{config.partitions} partitions → {in_topic} in "
                      f"{time.monotonic() - t0:.1f}s")
        # A fresh broker's JIT compiles for the first tens of seconds of traffic (its C2
        # thread took ~0.4 of the 2 cores in the first run measured): one untimed run of the
        # first system goes before the timed ones, so no system pays for the warm-up.
        if not config.quick and systems:
            console.print(f"warm-up: {systems[0].name} (not counted) …", end=" ")
            console.print(_line(bench.throughput(systems[0], in_topic, expected, 0)))
        for rep in range(1, config.repetitions + 1):
            for system in systems:
                if system.role == "snapline" and missing:
                    if rep == 1:
                        results.append(RunResult(system.name, "throughput", rep,
                                                 status="SKIPPED", problems=[missing]))
                        console.print(f"[yellow]{system.name}[/yellow]: SKIPPED ({missing})")
                    continue
                if over_budget(system, "throughput", rep):
                    continue
                console.print(f"[cyan]{system.name}[/cyan] repetition {rep}/"
                              f"{config.repetitions} …", end=" ")
                result = bench.throughput(system, in_topic, expected, rep,
                                          profile=config.profile and rep == 1)
                results.append(result)
                console.print(_line(result))
        if config.latency:
            for system in systems:
                if config.latency_only and system.name not in config.latency_only:
                    continue
                if system.role == "snapline" and missing or over_budget(system, "latency", 0):
                    continue
                console.print(f"[cyan]{system.name}[/cyan] latency at "
                              f"{config.latency_rate:,.0f} records/s …", end=" ")
                result = bench.latency(system)
                results.append(result)
                console.print(_line(result))
    finally:
        topics.delete([t for t in list(topics.created)])
        topics.delete_containing(prefix)
        if config.keep_workdir:
            console.print(f"work dir kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    rows = report.summarize_systems(systems, results)
    title = (f"suite {suite.name}: {config.records:,} records keyed by {suite.keyed_by}, "
             f"{config.keys:,} customers, {config.partitions} partitions, "
             f"{config.repetitions} repetition(s) — {m.description}")
    report.print_table(rows, title, console)
    payload = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": asdict(m) | {"short": m.short, "description": m.description},
        "command": config.command,
        "config": asdict(config) | {"output": str(config.output or "")},
        "settings": asdict(settings) | {"profile_dir": str(profile_dir or "")},
        "definitions": {
            "records_per_s": "N / (time the read_committed verifier saw the N-th output - "
                             "time the system handed its first input record to its code)",
            "latency": "time an output became visible to a read_committed consumer - produce "
                       f"time of its input, at {config.latency_rate:,.0f} records/s after a "
                       "warm-up",
            "commit": "baselines: transaction commit (A) or flush+offset commit (B); Quix: "
                      "Checkpoint.commit; Snapline: checkpoint duration from its log",
            "peak_rss_mb": "ru_maxrss of the system's process (os.wait4)",
            "ratios": "median records/s of the system / that of baseline A or the peer",
        },
        "summary": rows,
        "runs": [r.to_json() for r in results],
        "snapline_runtime": missing or "available",
    }
    path = config.output or report.results_path(m, config.quick, suite.results_suffix)
    report.write_results(path, payload)
    console.print(f"results: {path}")
    if profile_dir is not None:
        console.print(f"profiles: {profile_dir}")
    if not config.quick and config.output is None:
        report.update_readme(
            f"Measured {payload['date']} on {m.description}:\n\n"
            f"`{config.command}`\n\n{report.markdown_table(rows)}\n\n"
            f"Raw results: [`results/{path.name}`](results/{path.name})",
            marker=suite.readme_marker)
        console.print(f"table updated in {report.README}")
    return payload


def any_failed(payload: dict[str, Any]) -> bool:
    return any(r["status"] == "FAILED" for r in payload["runs"])
