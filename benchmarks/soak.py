"""``python -m benchmarks.soak``: do long runs stay bounded? (issue 9, item 9)

Per state backend (memory and rocksdb, run concurrently on one broker): two Snapline workers
run the keyed running total (``benchmarks.snapline_pipelines:running_total``, exactly-once,
checkpoint every second) while one producer thread writes a steady ``--rate`` records/s to
each backend's input topic. Every ``--sample-seconds`` the harness reads, per worker process,
RSS, threads and open file descriptors from ``/proc/<pid>`` and the size of its local state
directory, and per job the size of its checkpoint storage and its consumer lag (records
produced minus the offsets the job committed). The verdict per series is
``soak_analysis.verdict`` (last third's max within 10 % of the middle third's max).

Writes JSON (and a PNG plot when matplotlib is installed) to ``benchmarks/results/`` (runs
shorter than 10 minutes: ``benchmarks/results/tmp/``). Exits 1 when a worker died or a job
stopped committing checkpoints: that run measured nothing. A growing series is a finding,
reported in the table and the JSON, not an exit code.

Threads: the main thread starts everything and samples; one producer thread produces.
"""

from __future__ import annotations

import os
import secrets
import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from confluent_kafka import Consumer, Producer, TopicPartition
from rich.console import Console
from rich.table import Table

from benchmarks import report
from benchmarks.broker import kafka
from benchmarks.child_env import ChildEnv
from benchmarks.kafka_admin import Topics
from benchmarks.process import Child
from benchmarks.snapline_runs import METRICS_ENV
from benchmarks.soak_analysis import (
    DEFAULT_TOLERANCE,
    JOB_METRICS,
    WORKER_METRICS,
    Series,
    judge,
    markdown_summary,
    plot,
    summary_rows,
)
from benchmarks.workload import _produce, customer_key, encode_record, producer_config

#: A job that commits no checkpoint for this long (with input flowing) has stalled.
STALL_SECONDS = 120.0


@dataclass(frozen=True)
class SoakConfig:
    minutes: float
    backends: tuple[str, ...] = ("memory", "rocksdb")
    workers: int = 2
    rate: float = 1000.0
    keys: int = 100_000
    partitions: int = 4
    sample_seconds: float = 10.0
    checkpoint_interval: float = 1.0
    tolerance: float = DEFAULT_TOLERANCE


@dataclass
class Worker:
    """One worker process of one backend's job, and where its files are."""

    backend: str
    worker_id: str
    child: Child
    local_dir: Path
    metrics_file: Path
    checkpoints: int = 0
    _metrics_offset: int = 0

    def count_checkpoints(self) -> int:
        """Committed checkpoints so far, from the worker's SNAPLINE_METRICS_FILE (read on)."""
        try:
            with open(self.metrics_file, "rb") as fh:
                fh.seek(self._metrics_offset)
                data = fh.read()
        except FileNotFoundError:
            return self.checkpoints
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._metrics_offset += end
        self.checkpoints += data[:end].count(b'"event": "checkpoint"')
        return self.checkpoints


def proc_stats(pid: int) -> dict[str, float] | None:
    """RSS (MiB), threads and open file descriptors of a live process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    values = {}
    for line in status.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "Threads"):
            values[key] = int(rest.split()[0])
    if "VmRSS" not in values:  # a zombie has no memory map
        return None
    return {"rss": values["VmRSS"] / 1024, "threads": values["Threads"], "open_files": fds}


def dir_mib(path: Path) -> float:
    """Total size of the files under ``path``; files deleted while walking are skipped."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    return total / (1024 * 1024)


class SteadyProducer:
    """Produces ``rate`` records/s to each of ``topics`` (the same records to every topic)."""

    def __init__(self, bootstrap: str, topics: list[str], rate: float, keys: int) -> None:
        self._producer = Producer(producer_config(bootstrap, **{"linger.ms": 5}))
        self._topics = topics
        self._rate = rate
        self._keys = keys
        self._stop = threading.Event()
        self.produced = 0
        self._thread = threading.Thread(target=self._loop, name="soak-producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        start = time.monotonic()
        i = 0
        while not self._stop.is_set():
            due = int((time.monotonic() - start) * self._rate)
            while i < due:
                customer = customer_key((i * 7919) % self._keys)
                value = encode_record(customer, 1 + i % 100, int(time.time() * 1000))
                for topic in self._topics:
                    _produce(self._producer, topic, customer.encode(), value)
                i += 1
            self.produced = i
            self._producer.poll(0)
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._producer.flush(30)


class LagReader:
    """Committed offsets of a job's consumer group on its input topic, read without joining
    the group: lag = records produced - records whose offsets the job committed."""

    def __init__(self, bootstrap: str, env: ChildEnv, partitions: int) -> None:
        self._consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": env.group, "enable.auto.commit": False}
        )
        self._partitions = [TopicPartition(env.in_topic, p) for p in range(partitions)]

    def committed(self) -> int | None:
        try:
            offsets = self._consumer.committed(self._partitions, timeout=5)
        except Exception:  # a sample is skipped, the run goes on
            return None
        return sum(max(0, tp.offset) for tp in offsets)

    def close(self) -> None:
        self._consumer.close()


def _start_worker(
    config: SoakConfig, bootstrap: str, backend: str, index: int, env: ChildEnv, base: Path
) -> Worker:
    worker_id = f"w{index}"
    local_root = base / backend / "local"  # the worker keeps its files in local_root/<id>
    metrics_file = base / backend / f"metrics-{worker_id}.jsonl"
    argv = [
        sys.executable,
        "-m",
        "benchmarks.snapline_entry",
        "run",
        "benchmarks.snapline_pipelines:running_total",
        "--bootstrap-servers",
        bootstrap,
        "--worker-id",
        worker_id,
        "--checkpoint-dir",
        env.state_dir,
        "--local-dir",
        str(local_root),
        "--log-level",
        "WARNING",
    ]
    child = Child(
        argv,
        {**env.to_environ(), METRICS_ENV: str(metrics_file)},
        base / backend / f"{worker_id}.log",
    )
    return Worker(backend, worker_id, child, local_root / worker_id, metrics_file)


def run_soak(config: SoakConfig, bootstrap: str, console: Console, command: str) -> dict[str, Any]:
    token = secrets.token_hex(3)
    base = Path(tempfile.mkdtemp(prefix="snapline-soak-"))
    topics = Topics(bootstrap)
    envs: dict[str, ChildEnv] = {}
    for backend in config.backends:
        (base / backend).mkdir(parents=True)
        envs[backend] = ChildEnv(
            bootstrap=bootstrap,
            in_topic=topics.create(f"soak-{token}-{backend}-in", config.partitions),
            out_topic=topics.create(f"soak-{token}-{backend}-out", config.partitions),
            group=f"soak-{token}-{backend}",
            start_file=str(base / backend / "started"),
            stats_file=str(base / backend / "stats.json"),
            state_dir=str(base / backend / "checkpoints"),
            commit_interval=config.checkpoint_interval,
            backend=backend,
        )
    producer = SteadyProducer(
        bootstrap, [e.in_topic for e in envs.values()], config.rate, config.keys
    )
    lag_readers = {b: LagReader(bootstrap, e, config.partitions) for b, e in envs.items()}
    workers: list[Worker] = []
    series: dict[tuple[str, str, str], Series] = {}
    problems: list[str] = []
    duration = config.minutes * 60
    started = time.monotonic()
    try:
        producer.start()
        for backend, env in envs.items():
            for i in range(config.workers):
                workers.append(_start_worker(config, bootstrap, backend, i, env, base))
        started = time.monotonic()
        last_progress = {b: (started, 0) for b in config.backends}
        next_sample = started
        console.print(
            f"soak: {len(workers)} workers ({', '.join(config.backends)}), "
            f"{config.rate:,.0f} records/s per job, {config.minutes:g} min, "
            f"sampling every {config.sample_seconds:g} s; files in {base}"
        )
        while time.monotonic() - started < duration and not problems:
            time.sleep(max(0.0, next_sample - time.monotonic()))
            next_sample += config.sample_seconds
            now = time.monotonic()
            t = now - started
            for w in workers:
                stats = proc_stats(w.child.pid)
                if stats is None or not w.child.running():
                    problems.append(
                        f"{w.backend} {w.worker_id} exited after {t:.0f}s; log "
                        f"{w.child.log_path}:\n{_tail(w.child.log_path)}"
                    )
                    continue
                stats["local_state"] = dir_mib(w.local_dir)
                for metric, unit, _label in WORKER_METRICS:
                    key = (w.backend, w.worker_id, metric)
                    s = series.setdefault(key, Series(w.backend, w.worker_id, metric, unit))
                    s.points.append((t, float(stats[metric])))
                w.count_checkpoints()
            produced = producer.produced
            for backend, env in envs.items():
                committed = lag_readers[backend].committed()
                job_values = {
                    "checkpoint_storage": dir_mib(Path(env.state_dir)),
                    "lag": None if committed is None else float(produced - committed),
                }
                for metric, unit, _label in JOB_METRICS:
                    value = job_values[metric]
                    if value is None:
                        continue
                    key = (backend, "job", metric)
                    s = series.setdefault(key, Series(backend, "job", metric, unit))
                    s.points.append((t, value))
                total = sum(w.checkpoints for w in workers if w.backend == backend)
                since, seen = last_progress[backend]
                if total > seen:
                    last_progress[backend] = (now, total)
                elif now - since > STALL_SECONDS:
                    problems.append(
                        f"{backend}: no checkpoint committed for {now - since:.0f}s "
                        f"(input flowing at {config.rate:g}/s)"
                    )
            if int(t) // 60 != int(t - config.sample_seconds) // 60:
                console.print(f"soak: {t / 60:.1f} min: " + _progress(workers, series))
    finally:
        elapsed = time.monotonic() - started
        producer.stop()
        exits = {f"{w.backend}/{w.worker_id}": w.child.stop(grace=40) for w in workers}
        for w in workers:
            w.count_checkpoints()
        for reader in lag_readers.values():
            reader.close()
        topics.delete(list(topics.created))
        shutil.rmtree(base, ignore_errors=True)
    all_series = list(series.values())
    judge(all_series, min(duration, elapsed), config.tolerance)
    for backend in config.backends:
        if not any(w.checkpoints for w in workers if w.backend == backend):
            problems.append(f"{backend}: no checkpoint committed")
    return {
        "benchmark": "soak",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": asdict(report.machine()),
        "command": command,
        "config": asdict(config),
        "duration_s": round(elapsed, 1),
        "status": "FAILED" if problems else "ok",
        "problems": problems,
        "produced_per_job": producer.produced,
        "workers": [
            {
                "backend": w.backend,
                "worker": w.worker_id,
                "checkpoints_committed": w.checkpoints,
                "exit": {
                    "returncode": exits[f"{w.backend}/{w.worker_id}"].returncode,
                    "stopped_by": exits[f"{w.backend}/{w.worker_id}"].stopped_by,
                    "peak_rss_mb": round(exits[f"{w.backend}/{w.worker_id}"].peak_rss_mb, 1),
                },
            }
            for w in workers
        ],
        "series": [s.to_json() for s in all_series],
    }


def _progress(workers: list[Worker], series: dict[tuple[str, str, str], Series]) -> str:
    parts = []
    for w in workers:
        rss = series.get((w.backend, w.worker_id, "rss"))
        mib = f"{rss.points[-1][1]:.0f} MiB" if rss and rss.points else "?"
        parts.append(f"{w.backend}/{w.worker_id} {mib} {w.checkpoints} chk")
    return ", ".join(parts)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def print_summary(payload: dict[str, Any], console: Console) -> None:
    table = Table(title=f"soak: {payload['duration_s'] / 60:.1f} min, status {payload['status']}")
    for column in ("series", "metric", "first", "middle-third max", "last-third max", "verdict"):
        table.add_column(column)
    for row in summary_rows([_series_from_json(s) for s in payload["series"]]):
        table.add_row(*row)
    console.print(table)
    for problem in payload["problems"]:
        console.print(f"[red]problem:[/red] {problem}")


def _series_from_json(data: dict[str, Any]) -> Series:
    return Series(
        data["backend"],
        data["worker"],
        data["metric"],
        data["unit"],
        [(float(t), float(v)) for t, v in data["points"]],
        data["verdict"],
    )


def default_output(minutes: float) -> Path:
    m = report.machine()
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    folder = report.RESULTS_DIR if minutes >= 10 else report.RESULTS_DIR / "tmp"
    return folder / f"soak-{date}-{m.short}.json"


@click.command()
@click.option("--minutes", type=float, default=30.0, show_default=True)
@click.option("--backends", default="memory,rocksdb", show_default=True)
@click.option("--workers", type=int, default=2, show_default=True, help="workers per backend")
@click.option("--rate", type=float, default=1000.0, show_default=True, help="records/s per job")
@click.option(
    "--keys", type=int, default=100_000, show_default=True, help="all seen within keys/rate s"
)
@click.option("--partitions", type=int, default=4, show_default=True)
@click.option("--sample-seconds", type=float, default=10.0, show_default=True)
@click.option("--tolerance", type=float, default=DEFAULT_TOLERANCE, show_default=True)
@click.option("--bootstrap-servers", default=None, help="default: start a local broker")
@click.option(
    "--output",
    type=click.Path(path_type=Path),
    default=None,
    help="results JSON (the PNG goes beside it); default benchmarks/results/"
    "soak-<date>-<machine>.json, runs under 10 minutes in benchmarks/results/tmp/",
)
def main(
    minutes: float,
    backends: str,
    workers: int,
    rate: float,
    keys: int,
    partitions: int,
    sample_seconds: float,
    tolerance: float,
    bootstrap_servers: str | None,
    output: Path | None,
) -> None:
    """Run steady input through both state backends for MINUTES and judge whether RSS,
    threads, open files, local state and checkpoint storage stay bounded."""
    config = SoakConfig(
        minutes=minutes,
        backends=tuple(b.strip() for b in backends.split(",") if b.strip()),
        workers=workers,
        rate=rate,
        keys=keys,
        partitions=partitions,
        sample_seconds=sample_seconds,
        tolerance=tolerance,
    )
    console = Console() if sys.stdout.isatty() else Console(width=140)
    command = "python -m benchmarks.soak " + shlex.join(sys.argv[1:])
    with kafka(bootstrap_servers) as bootstrap:
        payload = run_soak(config, bootstrap, console, command)
    path = output or default_output(minutes)
    png = plot(
        [_series_from_json(s) for s in payload["series"]],
        payload["duration_s"],
        path.with_suffix(".png"),
        f"Snapline soak, {payload['duration_s'] / 60:.0f} min, {rate:g} records/s per job, "
        f"checkpoint every {config.checkpoint_interval:g} s, {workers} workers per backend",
    )
    payload["plot"] = png.name if png else None
    report.write_results(path, payload)
    print_summary(payload, console)
    if output is None and path.parent == report.RESULTS_DIR and payload["status"] == "ok":
        section = markdown_summary(payload, path.name, png.name if png else None)
        report.update_readme(section, marker="soak-summary")
        console.print("soak: updated the Soak section of benchmarks/README.md")
    console.print(f"soak: wrote {path}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
    if payload["status"] != "ok":
        sys.exit(1)


if __name__ == "__main__":
    main()
