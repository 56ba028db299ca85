"""``python -m benchmarks recovery``: how long a worker that was SIGKILLed takes, after its
restart, to commit its first new output, with ~150 B of state for each of many keys.

Per system: produce one record per key (the state is built), run the worker until every
output is committed (so a checkpoint holds all state), SIGKILL it, produce one more record
for an existing key, restart the worker and time restart → that record's output is visible
to a read_committed consumer. The restarted worker must output old total + amount (the state
was restored) and nothing twice.

Then ``--restarts N`` cycles in all (default 5): SIGKILL, one more record for another existing
key, restart, timed the same way; the table gives p50 and p99 over them, and for Snapline where
the time goes, from the restarted worker's own events (``SNAPLINE_METRICS_FILE``): process
start and imports → ``started``; ``init_transactions`` → ``transactions_ready``; joining the
group → ``assigned``; restoring state → ``restored``; the first checkpoint's commit; and that
commit → the output seen by the verifier.

Snapline restores from its checkpoint storage (its local working directory is wiped first, as
on a new host), or, as ``snapline-rocksdb-local``, from the files its previous incarnation
left on local disk (local recovery); Quix Streams restores from its changelog topic (state
directory wiped), and for reference from its local RocksDB (state directory kept).
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from rich.console import Console
from rich.table import Table

from benchmarks import report
from benchmarks.child_env import ChildEnv, read_start_time
from benchmarks.kafka_admin import Topics
from benchmarks.process import Child
from benchmarks.snapline_runs import METRICS_ENV, checkpoint_metrics, runtime_missing
from benchmarks.systems import System
from benchmarks.verifier import Verifier, check
from benchmarks.workload import Expected, each_key_once, encode_record, prepare_input
from examples.workers import read_events

#: Input record size that gives ~150 B of JSON state per key ({"total": t, "note": 130 x}).
STATE_RECORD_BYTES = 194


@dataclass(frozen=True)
class RecoverySystem:
    name: str
    system: System
    wipe: str  # what is deleted before the restart: "local" | "state" | ""
    notes: str


def _snapline(backend: str) -> System:
    return System(
        name=f"snapline-{backend}", label=f"Snapline {backend}", role="snapline",
        module="benchmarks.snapline_entry",
        args=("run", "benchmarks.snapline_pipelines:running_total_with_note",
              "--bootstrap-servers", "{bootstrap}", "--worker-id", "0"),
        backend=backend,
    )


_QUIX = System(name="quix", label="Quix Streams", role="peer",
               module="benchmarks.quix_peer", args=("--keep-note",))

RECOVERY_SYSTEMS: tuple[RecoverySystem, ...] = (
    RecoverySystem("snapline-rocksdb", _snapline("rocksdb"), "local",
                   "restore from checkpoint storage, local working dir wiped"),
    RecoverySystem("snapline-rocksdb-local", _snapline("rocksdb"), "",
                   "local recovery: the files the killed worker left on disk are reused"),
    RecoverySystem("snapline-memory", _snapline("memory"), "local",
                   "restore from checkpoint storage, local working dir wiped"),
    RecoverySystem("quix-changelog", _QUIX, "state",
                   "state dir wiped: rebuilt from the changelog topic"),
    RecoverySystem("quix-local", _QUIX, "",
                   "state dir kept: local RocksDB plus changelog catch-up"),
)


@dataclass(frozen=True)
class RecoveryConfig:
    keys: int
    quick: bool
    only: tuple[str, ...]
    partitions: int
    output: Path | None
    command: str
    #: SIGKILL → restart cycles per system (p50/p99 over them)
    restarts: int = 5


@dataclass
class RecoveryResult:
    system: str
    status: str = "ok"
    problems: list[str] = field(default_factory=list)
    keys: int = 0
    build_records_per_s: float | None = None
    state_bytes_checkpoint: int | None = None
    local_state_mb: float | None = None
    checkpoint_storage_mb: float | None = None
    recovery_s: float | None = None
    restart_to_first_record_s: float | None = None
    #: every restart → first output (the first one is ``recovery_s``)
    recoveries_s: list[float] = field(default_factory=list)
    recovery_p50_s: float | None = None
    recovery_p99_s: float | None = None
    #: Snapline: median seconds of each startup phase over the restarts (see the module doc)
    phases_s: dict[str, float] = field(default_factory=dict)
    peak_rss_mb_build: float | None = None
    peak_rss_mb_restart: float | None = None
    #: ``os.getloadavg()`` (1, 5, 15 min) when this system's run started and ended: the machine
    #: is shared, so every number carries the load it was measured under
    load_start: tuple[float, ...] = ()
    load_end: tuple[float, ...] = ()
    log: str = ""
    log_tail: str = ""
    notes: str = ""

    def fail(self, problem: str) -> None:
        self.status = "FAILED"
        self.problems.append(problem)


def select_recovery(only: tuple[str, ...]) -> list[RecoverySystem]:
    names = [s.name for s in RECOVERY_SYSTEMS]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; choose from {names}")
    return [s for s in RECOVERY_SYSTEMS if not only or s.name in only]


def _load() -> tuple[float, ...]:
    return tuple(round(x, 2) for x in os.getloadavg())


def _dir_mb(path: Path) -> float:
    if not path.exists():
        return 0.0
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20, 1)


class RecoveryRun:
    """One system's build → SIGKILL → restart cycle."""

    def __init__(self, bootstrap: str, topics: Topics, prefix: str, workdir: Path,
                 config: RecoveryConfig) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.prefix = prefix
        self.workdir = workdir
        self.config = config
        self.startup_timeout = 120.0
        # Bounds that grow with the state: a checkpoint (Snapline) or commit (Quix) of 10M keys
        # may take longer between two outputs than one of 1M, and Quix Streams restores its
        # changelog at ~50k records/s (10M keys: ~200 s; the bound allows 10k/s).
        self.stall_timeout = (60.0 if config.quick else 120.0) + config.keys / 100_000
        self.restore_timeout = self.startup_timeout + 600.0 + config.keys / 10_000
        self.keep_logs = bool(os.environ.get("BENCH_KEEP_WORKDIR"))

    def run(self, spec: RecoverySystem, console: Console) -> RecoveryResult:
        cfg = self.config
        result = RecoveryResult(system=spec.name, keys=cfg.keys, notes=spec.notes,
                                load_start=_load())
        group = f"{self.prefix}-{spec.name}"
        rundir = self.workdir / spec.name
        rundir.mkdir(parents=True)
        in_topic = self.topics.create(f"{group}-in", cfg.partitions)
        out_topic = self.topics.create(f"{group}-out", cfg.partitions)
        t0 = time.monotonic()
        expected = prepare_input(self.bootstrap, in_topic, each_key_once(cfg.keys),
                                 STATE_RECORD_BYTES, random_notes=True)
        console.print(f"  {cfg.keys:,} records of {STATE_RECORD_BYTES} B produced in "
                      f"{time.monotonic() - t0:.1f}s")
        verifier = Verifier(self.bootstrap, out_topic, cfg.partitions, "total")
        env = ChildEnv(bootstrap=self.bootstrap, in_topic=in_topic, out_topic=out_topic,
                       group=group, start_file=str(rundir / "started-1"),
                       stats_file=str(rundir / "stats.json"), state_dir=str(rundir / "state"),
                       backend=spec.system.backend, guarantee="exactly_once")
        metrics = rundir / "metrics.jsonl"
        child: Child | None = None
        try:
            # 1. build the state
            child = self._launch(spec, env, rundir / "build.log", metrics)
            result.log = str(rundir / "build.log")
            started = self._wait_started(child, env.start_file)
            if started is None:
                result.fail("the worker consumed nothing within "
                            f"{self.startup_timeout:.0f}s")
                return self._finish(result, child, verifier)
            seen, why = verifier.wait_for(cfg.keys, self.startup_timeout + cfg.keys / 200,
                                          self.stall_timeout, child.running)
            if seen is None:
                result.fail(f"building state: {why}")
                return self._finish(result, child, verifier)
            result.build_records_per_s = round(cfg.keys / max(seen - started, 1e-6), 1)
            time.sleep(1.0)  # let the process settle past its last commit
            if spec.system.role == "snapline":
                result.local_state_mb = _dir_mb(rundir / ".snapline-local")
                result.checkpoint_storage_mb = _dir_mb(Path(env.state_dir))
            else:
                result.local_state_mb = _dir_mb(Path(env.state_dir))
            snapshots = checkpoint_metrics(metrics)["state_bytes"]
            result.state_bytes_checkpoint = int(max(snapshots)) if snapshots else None
            # 2. crash
            exit_ = child.kill()
            result.peak_rss_mb_build = round(exit_.peak_rss_mb, 1)
            child = None
            if spec.wipe == "state":
                shutil.rmtree(env.state_dir, ignore_errors=True)
            elif spec.wipe == "local":
                shutil.rmtree(rundir / ".snapline-local", ignore_errors=True)
            # 3. one more record for an existing key, then restart
            customer, amount = "c0000000", 7
            self._produce_one(in_topic, customer, amount)
            expected.add(customer, amount)
            restart_env = ChildEnv(**{**asdict(env), "start_file": str(rundir / "started-2")})
            child = self._launch(spec, restart_env, rundir / "restart.log", metrics)
            result.log = str(rundir / "restart.log")
            seen, why = verifier.wait_for(cfg.keys + 1, self.restore_timeout,
                                          self.restore_timeout, child.running)
            if seen is None:
                result.fail(f"after restart: {why}")
                return self._finish(result, child, verifier, expected)
            result.recovery_s = round(seen - child.started_at, 3)
            first = read_start_time(restart_env.start_file)
            if first is not None:
                result.restart_to_first_record_s = round(first - child.started_at, 3)
            result.recoveries_s.append(result.recovery_s)
            phases = [self._phases(metrics, child, seen)]
            # 4. more cycles: kill again, one record for another key, restart
            for cycle in range(2, cfg.restarts + 1):
                time.sleep(1.5)  # past the restarted worker's first checkpoints
                exit_ = child.kill()
                child = None
                if spec.wipe == "state":
                    shutil.rmtree(env.state_dir, ignore_errors=True)
                elif spec.wipe == "local":
                    shutil.rmtree(rundir / ".snapline-local", ignore_errors=True)
                customer = f"c{cycle:07d}"
                self._produce_one(in_topic, customer, amount)
                expected.add(customer, amount)
                cycle_env = ChildEnv(
                    **{**asdict(env), "start_file": str(rundir / f"started-{cycle + 1}")}
                )
                child = self._launch(spec, cycle_env, rundir / f"restart-{cycle}.log", metrics)
                result.log = str(rundir / f"restart-{cycle}.log")
                seen, why = verifier.wait_for(cfg.keys + cycle, self.restore_timeout,
                                              self.restore_timeout, child.running)
                if seen is None:
                    result.fail(f"after restart {cycle}: {why}")
                    return self._finish(result, child, verifier, expected)
                result.recoveries_s.append(round(seen - child.started_at, 3))
                phases.append(self._phases(metrics, child, seen))
            times = sorted(result.recoveries_s)
            result.recovery_p50_s = round(statistics.median(times), 3)
            # nearest rank: with few restarts p99 is the slowest one
            result.recovery_p99_s = times[min(len(times) - 1, round(0.99 * len(times) + 0.5) - 1)]
            names = {name for p in phases for name in p}
            result.phases_s = {
                name: round(statistics.median(p[name] for p in phases if name in p), 3)
                for name in PHASES
                if name in names
            }
            return self._finish(result, child, verifier, expected)
        finally:
            if child is not None and child.running():
                child.kill()
            verifier.stop()
            self.topics.delete([in_topic, out_topic])
            self.topics.delete_containing(group)
            if not self.keep_logs:
                shutil.rmtree(rundir, ignore_errors=True)

    @staticmethod
    def _phases(metrics: Path, child: Child, seen: float) -> dict[str, float]:
        """Seconds of each startup phase of the worker ``child`` (Snapline's events; empty
        for other systems): the time from the previous phase's end to its event."""
        events = [e for e in read_events(metrics) if e.get("pid") == child.pid]
        at: dict[str, float] = {}
        for e in events:
            kind = e.get("event")
            if kind in ("started", "transactions_ready", "assigned", "restored", "checkpoint"):
                at.setdefault(str(kind), float(e["time"]))
        order = [("started", "process start + imports"),
                 ("transactions_ready", "init_transactions"), ("assigned", "group join"),
                 ("restored", "restore"), ("checkpoint", "first checkpoint")]
        phases: dict[str, float] = {}
        previous = child.started_at
        for kind, name in order:
            if kind not in at:
                return phases
            phases[name] = round(at[kind] - previous, 3)
            previous = at[kind]
        phases["commit → output seen"] = round(seen - previous, 3)
        return phases

    def _launch(self, spec: RecoverySystem, env: ChildEnv, log: Path, metrics: Path) -> Child:
        return Child(spec.system.argv(self.bootstrap),
                     {**env.to_environ(), METRICS_ENV: str(metrics)}, log)

    def _wait_started(self, child: Child, start_file: str) -> float | None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline and child.running():
            started = read_start_time(start_file)
            if started is not None:
                return started
            time.sleep(0.05)
        return read_start_time(start_file)

    def _produce_one(self, topic: str, customer: str, amount: int) -> None:
        producer = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True})
        producer.produce(topic, encode_record(customer, amount, int(time.time() * 1000),
                                              STATE_RECORD_BYTES), customer.encode())
        if producer.flush(30):
            raise RuntimeError(f"could not produce the post-crash record to {topic}")

    def _finish(self, result: RecoveryResult, child: Child, verifier: Verifier,
                expected: Expected | None = None) -> RecoveryResult:
        result.load_end = _load()
        exit_ = child.stop(30.0)
        if result.recovery_s is not None:
            result.peak_rss_mb_restart = round(exit_.peak_rss_mb, 1)
        verifier.drain()
        if expected is not None and result.status == "ok":
            for problem in check(verifier.tally, expected, exactly_once=True):
                result.fail("wrong output: " + problem)
        if result.status != "ok":
            result.log_tail = exit_.log_tail
        return result


PHASES = ("process start + imports", "init_transactions", "group join", "restore",
          "first checkpoint", "commit → output seen")
COLUMNS = ("system", "state in checkpoint", "checkpoint dir", "local state", "build rec/s",
           "restart → first output p50", "p99", "restarts", "restart → first record",
           "RSS after restart")


def _cells(results: list[RecoveryResult]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for r in results:
        if r.status != "ok":
            rows.append((r.system, "", "", "", "", r.status, "", "", "", ""))
            continue
        rows.append((
            r.system,
            f"{r.state_bytes_checkpoint / 2**20:,.0f} MB" if r.state_bytes_checkpoint else "–",
            f"{r.checkpoint_storage_mb:,.0f} MB" if r.checkpoint_storage_mb else "–",
            f"{r.local_state_mb:,.0f} MB" if r.local_state_mb else "–",
            f"{r.build_records_per_s:,.0f}" if r.build_records_per_s else "–",
            f"{r.recovery_p50_s:.2f} s" if r.recovery_p50_s is not None else "–",
            f"{r.recovery_p99_s:.2f} s" if r.recovery_p99_s is not None else "–",
            str(len(r.recoveries_s)),
            f"{r.restart_to_first_record_s:.2f} s" if r.restart_to_first_record_s else "–",
            f"{r.peak_rss_mb_restart:,.0f} MB" if r.peak_rss_mb_restart else "–",
        ))
    return rows


def _table(results: list[RecoveryResult], title: str) -> Table:
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "system" else "right")
    for cells in _cells(results):
        table.add_row(*cells)
    return table


def _markdown(results: list[RecoveryResult]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "| --- |" + " ---: |" * (len(COLUMNS) - 1)]
    lines += ["| " + " | ".join(cells) + " |" for cells in _cells(results)]
    split = [r for r in results if r.phases_s]
    if split:
        lines += ["", "Where a Snapline restart's time goes (median seconds over the restarts):",
                  "", "| system | " + " | ".join(PHASES) + " |",
                  "| --- |" + " ---: |" * len(PHASES)]
        lines += ["| " + r.system + " | "
                  + " | ".join(f"{r.phases_s[p]:.2f}" if p in r.phases_s else "–" for p in PHASES)
                  + " |" for r in split]
    return "\n".join(lines)


def _ratios(results: list[RecoveryResult]) -> dict[str, float]:
    """quix-changelog's p50 / each other system's p50 (measured in the same run)."""
    quix = next((r.recovery_p50_s for r in results
                 if r.system == "quix-changelog" and r.status == "ok"), None)
    if not quix:
        return {}
    return {r.system: round(quix / r.recovery_p50_s, 1) for r in results
            if r.status == "ok" and r.recovery_p50_s and r.system != "quix-changelog"}


def run_recovery(config: RecoveryConfig, bootstrap: str, console: Console) -> dict[str, Any]:
    specs = select_recovery(config.only)
    missing = runtime_missing()
    prefix = f"rec-{datetime.now(UTC):%m%d%H%M%S}-{secrets.token_hex(2)}"
    workdir = Path(tempfile.mkdtemp(prefix="snapline-recovery-"))
    topics = Topics(bootstrap)
    runner = RecoveryRun(bootstrap, topics, prefix, workdir, config)
    m = report.machine()
    console.print(f"[bold]machine[/bold]: {m.description}\n[bold]broker[/bold]: {bootstrap}")
    results: list[RecoveryResult] = []
    try:
        for spec in specs:
            if spec.system.role == "snapline" and missing:
                results.append(RecoveryResult(spec.name, status="SKIPPED", problems=[missing]))
                console.print(f"[yellow]{spec.name}[/yellow]: SKIPPED ({missing})")
                continue
            console.print(f"[cyan]{spec.name}[/cyan]: {spec.notes}")
            result = runner.run(spec, console)
            results.append(result)
            if result.status == "ok":
                console.print(f"  restart → first output: {result.recoveries_s} s; phases "
                              f"(median): {result.phases_s}")
            else:
                console.print(f"  [red]{result.status}[/red]: {'; '.join(result.problems)}")
    finally:
        if not runner.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    console.print(_table(results, f"recovery with {config.keys:,} keys of ~150 B state — "
                                  f"{m.description}"))
    payload = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": asdict(m) | {"short": m.short, "description": m.description},
        "command": config.command,
        "config": asdict(config) | {"output": str(config.output or "")},
        "definition": "recovery_s = time the read_committed verifier saw the first output "
                      "of the restarted worker - time the restarted process was started",
        "results": [asdict(r) for r in results],
        # the harness holds the expected effect and the verifier's tally of every key
        "harness_peak_rss_mb": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "restore_ratio_vs_quix_changelog": _ratios(results),
    }
    path = config.output or report.results_path(m, config.quick).with_name(
        report.results_path(m, config.quick).stem + "-recovery.json")
    report.write_results(path, payload)
    console.print(f"results: {path}")
    if not config.quick and config.output is None:
        report.update_readme(
            f"Measured {payload['date']} on {m.description}, {config.keys:,} keys:\n\n"
            f"`{config.command}`\n\n{_markdown(results)}\n\n"
            f"Raw results: [`results/{path.name}`](results/{path.name})",
            marker="recovery-table")
        console.print(f"table updated in {report.README}")
    return payload
