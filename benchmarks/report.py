"""Turning run results into the published artefacts: a summary per system with ratios, the
results JSON, a terminal table, and the table in ``benchmarks/README.md``."""

from __future__ import annotations

import json
import os
import platform
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.harness import RunResult
from benchmarks.stats import median
from benchmarks.systems import System

RESULTS_DIR = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent / "README.md"


@dataclass(frozen=True)
class Machine:
    cpu: str
    cores: int
    ram_gb: float
    python: str

    @property
    def short(self) -> str:
        """File-name friendly: ``xeon-3.80ghz-2c-24gb``."""
        cpu = re.sub(r"\((R|TM)\)|CPU|Processor|Intel|AMD|@", " ", self.cpu, flags=re.I)
        words = [w for w in re.split(r"[^A-Za-z0-9.]+", cpu.lower()) if w]
        return "-".join([*words[:3], f"{self.cores}c", f"{round(self.ram_gb)}gb"])

    @property
    def description(self) -> str:
        return f"{self.cpu}, {self.cores} cores, {self.ram_gb:.0f} GB RAM, Python {self.python}"


def machine() -> Machine:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram_gb = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram_gb = int(line.split()[1]) / 1024 / 1024
                break
    except OSError:
        pass
    return Machine(cpu=cpu, cores=os.cpu_count() or 0, ram_gb=round(ram_gb, 1),
                   python=platform.python_version())


# ---------------------------------------------------------------------- summary
def summarize_systems(systems: list[System], results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per system: median records/s over repetitions, ratios to baseline A and to the
    peer, latency, commit durations, peak RSS. A system with any failed run is FAILED."""
    rows: list[dict[str, Any]] = []
    for system in systems:
        runs = [r for r in results if r.system == system.name and r.kind == "throughput"]
        latency = next((r for r in results if r.system == system.name and r.kind == "latency"),
                       None)
        if not runs and latency is None:
            continue
        ok = [r for r in runs if r.status == "ok"]
        failed = [r for r in runs if r.status == "FAILED"]
        skipped = runs and all(r.status == "SKIPPED" for r in runs)
        rates = [r.records_per_s for r in ok if r.records_per_s]
        steady = [r.steady_records_per_s for r in ok if r.steady_records_per_s]
        commit_p50 = [r.commit_s["p50"] for r in ok if r.commit_s.get("p50") is not None]
        commit_p99 = [r.commit_s["p99"] for r in ok if r.commit_s.get("p99") is not None]
        chk_p50 = [r.checkpoint_s["p50"] for r in ok if r.checkpoint_s.get("p50") is not None]
        chk_p99 = [r.checkpoint_s["p99"] for r in ok if r.checkpoint_s.get("p99") is not None]
        status = "SKIPPED" if skipped else ("FAILED" if failed else "ok")
        if latency is not None and latency.status == "FAILED" and status == "ok":
            status = "FAILED (latency run)"
        rows.append({
            "system": system.name,
            "label": system.label,
            "role": system.role,
            "guarantee": "exactly-once" if system.exactly_once else "at-least-once",
            "status": status,
            "problems": sorted({p for r in [*runs, *([latency] if latency else [])]
                                for p in r.problems}),
            "repetitions": len(runs),
            "records_per_s": None if failed else median(rates),
            "records_per_s_all": rates,
            # Without the start-up and the wait for the last commit (verifier.produce_span_rate).
            "steady_records_per_s": None if failed else median(steady),
            "steady_records_per_s_all": steady,
            "latency_p50_s": latency.latency_s.get("p50") if latency and latency.status == "ok"
            else None,
            "latency_p99_s": latency.latency_s.get("p99") if latency and latency.status == "ok"
            else None,
            "commit_p50_s": median(commit_p50),
            "commit_p99_s": max(commit_p99) if commit_p99 else None,
            "checkpoint_p50_s": median(chk_p50),
            "checkpoint_p99_s": max(chk_p99) if chk_p99 else None,
            "state_bytes": max((r.state_bytes for r in ok if r.state_bytes), default=None),
            "peak_rss_mb": max((r.peak_rss_mb for r in ok if r.peak_rss_mb), default=None),
            "startup_s": median([r.startup_s for r in ok if r.startup_s is not None]),
            # CPU microseconds the system spent per record, and cores of the machine busy
            # (everything on it) while it ran: where the machine, not the system, was the limit.
            "cpu_us_per_record": median([r.cpu_s / r.records * 1e6 for r in ok
                                         if r.cpu_s is not None and r.records]),
            # ... of it in each kind of thread (main, librdkafka, other).
            "cpu_us_per_record_by_thread": {
                kind: median([r.cpu_threads_s[kind] / r.records * 1e6 for r in ok
                              if kind in r.cpu_threads_s and r.records])
                for kind in ("main", "librdkafka", "other")
            },
            "machine_busy_cores": median([r.machine_busy_cores for r in ok
                                          if r.machine_busy_cores is not None]),
            "machine_steal_cores": median([r.machine_steal_cores for r in ok
                                           if r.machine_steal_cores is not None]),
            # Seconds the main threads waited for a CPU per second of the run, summed over
            # the system's processes (two workers: up to 2).
            "main_wait_share": median([r.main_wait_s / r.elapsed_s for r in ok
                                       if r.main_wait_s is not None and r.elapsed_s]),
            "notes": system.notes,
        })
    base = next((r["records_per_s"] for r in rows if r["system"] == "baseline-a"), None)
    peer = next((r["records_per_s"] for r in rows if r["role"] == "peer"), None)
    steady_base = next(
        (r["steady_records_per_s"] for r in rows if r["system"] == "baseline-a"), None
    )
    for row in rows:
        rate = row["records_per_s"]
        row["vs_baseline_a"] = round(rate / base, 3) if rate and base else None
        row["vs_peer"] = round(rate / peer, 3) if rate and peer else None
        steady = row["steady_records_per_s"]
        row["steady_vs_baseline_a"] = (
            round(steady / steady_base, 3) if steady and steady_base else None
        )
    return rows


def write_results(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def results_path(m: Machine, quick: bool, suffix: str = "") -> Path:
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    folder = RESULTS_DIR / "tmp" if quick else RESULTS_DIR
    return folder / f"{date}-{m.short}{suffix}.json"


# ---------------------------------------------------------------------- tables
def _fmt(value: Any, spec: str = ",.0f", suffix: str = "") -> str:
    if value is None:
        return "–"
    return f"{value:{spec}}{suffix}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:,.0f} ms"


COLUMNS = ("system", "guarantee", "records/s", "× baseline A", "× Quix", "steady records/s",
           "steady × A", "latency p50", "latency p99", "commit p50", "commit p99",
           "checkpoint p99", "peak RSS")


def table_rows(rows: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for row in rows:
        rate = row["status"] if row["status"] != "ok" else _fmt(row["records_per_s"])
        out.append((
            row["system"], row["guarantee"], rate,
            _fmt(row["vs_baseline_a"], ".2f"), _fmt(row["vs_peer"], ".2f"),
            _fmt(row["steady_records_per_s"]), _fmt(row["steady_vs_baseline_a"], ".2f"),
            _ms(row["latency_p50_s"]), _ms(row["latency_p99_s"]),
            _ms(row["commit_p50_s"]), _ms(row["commit_p99_s"]), _ms(row["checkpoint_p99_s"]),
            _fmt(row["peak_rss_mb"], ",.0f", " MB"),
        ))
    return out


def print_table(rows: list[dict[str, Any]], title: str, console: Console) -> None:
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("system", "guarantee") else "right")
    for cells in table_rows(rows):
        table.add_row(*cells)
    console.print(table)
    for row in rows:
        for problem in row["problems"]:
            console.print(f"[red]{row['system']}[/red]: {problem}")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "| " + " | ".join("---" if c in ("system", "guarantee") else "---:"
                               for c in COLUMNS) + " |"]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(rows)]
    return "\n".join(lines)


def update_readme(section: str, readme: Path = README, marker: str = "results-table") -> None:
    """Replace the text between the ``<!-- {marker}:begin -->`` and ``:end`` lines."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    text = readme.read_text() if readme.exists() else ""
    if begin not in text or end not in text:
        text += f"\n{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{begin}\n{section.strip()}\n{end}{tail}")
