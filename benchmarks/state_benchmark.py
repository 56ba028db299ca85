"""State backend benchmark: checkpoint bytes and duration, incremental size, snapshot pause,
throughput while a checkpoint materializes, and restore speed — rocksdb against memory.

    python -m benchmarks.state_benchmark [--keys 1000000] [--backends rocksdb,memory]

Prints a table and writes ``benchmarks/results/state-<date>.json``. The workload is raw
backend puts of ~150-byte values under real state keys (key-group | len | key | state id);
each incremental step rewrites 1% of the keys, chosen uniformly at random.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.keygroups import key_group, state_key_prefix
from snapline.pipeline.state import create_backend
from snapline.pipeline.state.backend import KeyedStateBackend, StateHandle

RESULTS_DIR = Path(__file__).resolve().parent / "results"
VALUE_BYTES = 150
MAX_PARALLELISM = 128
MB = 1e6

TARGETS = {
    "incremental_ratio": 0.10,
    "pause_p99_ms": 50.0,
    "throughput_ratio": 0.80,
    "restore_mb_s": 100.0,
}


# ------------------------------------------------------------------ workload
class Workload:
    """Keys and values of the benchmark; values are pseudo-random hex, ~150 bytes each."""

    def __init__(self, keys: int, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.keys = [self._key(i) for i in range(keys)]
        # One shared pool of value bytes; a value is a window into it (cheap to produce).
        self._pool = os.urandom(VALUE_BYTES * 64).hex().encode()
        self._pool_span = len(self._pool) - VALUE_BYTES

    @staticmethod
    def _key(i: int) -> bytes:
        raw = f"customer-{i:09d}".encode()
        return state_key_prefix(key_group(raw, MAX_PARALLELISM), raw) + b"\x00"

    def value(self, i: int, version: int) -> bytes:
        offset = (i * 7919 + version * 104729) % self._pool_span
        return b"%d:" % version + self._pool[offset : offset + VALUE_BYTES - 8]

    def sample(self, fraction: float) -> list[int]:
        return self.rng.sample(range(len(self.keys)), max(1, int(len(self.keys) * fraction)))


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(pct / 100.0 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def handle_bytes(handle: StateHandle) -> int:
    return sum(f.size for f in handle.files)


def uploaded_bytes(handle: StateHandle) -> int:
    """Bytes this checkpoint wrote: the increment (rocksdb) or everything (memory)."""
    return int(handle.extra.get("incremental_bytes", handle_bytes(handle)))


def directory(task: str, checkpoint_id: int) -> str:
    return f"bench/tasks/{task}/chk-{checkpoint_id:010d}-bench"


def retain(
    backend_name: str,
    storage: CheckpointStorage,
    task: str,
    handles: list[tuple[int, StateHandle]],
    keep: int = 2,
) -> None:
    """The runtime's retention step: drop old checkpoint directories, then unreferenced files."""
    for checkpoint_id, _ in handles[:-keep]:
        storage.delete_dir(directory(task, checkpoint_id))
    if backend_name == "rocksdb":
        from snapline.pipeline.state.rocksdb import discard_unreferenced_files

        discard_unreferenced_files(storage, f"bench/tasks/{task}", [h for _, h in handles[-keep:]])
    del handles[:-keep]


def stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# ------------------------------------------------------------------ one backend
def run_backend(
    name: str,
    work: Workload,
    root: Path,
    checkpoints: int,
    options: dict[str, Any],
    say: Callable[[str], None],
) -> dict[str, Any]:
    n = len(work.keys)
    task = f"{name}-task"
    storage_root = root / f"{name}-storage"
    storage = CheckpointStorage(str(storage_root))
    task_dir = root / f"{name}-local"
    backend = create_backend(name, task_dir=str(task_dir), options=options)
    result: dict[str, Any] = {"backend": name, "keys": n, "options": options}

    say(f"[{name}] loading {n:,} keys")
    started = time.perf_counter()
    put = backend.put
    for i, key in enumerate(work.keys):
        put(key, work.value(i, 0))
    result["load_s"] = time.perf_counter() - started
    result["logical_mb"] = n * (len(work.keys[0]) + VALUE_BYTES) / MB

    settle(backend)

    say(f"[{name}] full checkpoint")
    handles: list[tuple[int, StateHandle]] = []
    t0 = time.perf_counter()
    snapshot = backend.snapshot(1)
    pause = time.perf_counter() - t0
    t1 = time.perf_counter()
    full = snapshot.materialize(storage, directory(task, 1))
    snapshot.release()
    handles.append((1, full))
    result["full_checkpoint"] = {
        "bytes": uploaded_bytes(full),
        "mb": uploaded_bytes(full) / MB,
        "pause_ms": pause * 1000,
        "materialize_s": time.perf_counter() - t1,
        "files": len(full.files),
    }

    say(f"[{name}] {checkpoints} incremental checkpoints, 1% of the keys updated before each")
    pauses: list[float] = []
    increments: list[int] = []
    materialize_s: list[float] = []
    for step in range(checkpoints):
        checkpoint_id = step + 2
        for i in work.sample(0.01):
            put(work.keys[i], work.value(i, checkpoint_id))
        t0 = time.perf_counter()
        snap = backend.snapshot(checkpoint_id)
        pauses.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        handle = snap.materialize(storage, directory(task, checkpoint_id))
        snap.release()
        materialize_s.append(time.perf_counter() - t1)
        increments.append(uploaded_bytes(handle))
        handles.append((checkpoint_id, handle))
        retain(name, storage, task, handles)
    last_id, last = handles[-1]
    result["incremental"] = {
        "first_bytes": increments[0],
        "first_ratio": increments[0] / uploaded_bytes(full),
        "mean_bytes": statistics.fmean(increments),
        "mean_ratio": statistics.fmean(increments) / uploaded_bytes(full),
        "max_bytes": max(increments),
        "all_bytes": increments,
        "materialize_s_mean": statistics.fmean(materialize_s),
    }
    result["pause_ms"] = {
        "p50": percentile(pauses, 50) * 1000,
        "p99": percentile(pauses, 99) * 1000,
        "max": max(pauses) * 1000,
        "count": len(pauses),
    }
    result["stored_mb_after_retention"] = stored_bytes(storage_root) / MB
    result["checkpoint_mb"] = handle_bytes(last) / MB

    probe = work.sample(0.0001)
    expected = [backend.get(work.keys[i]) for i in probe]

    say(f"[{name}] restore from the checkpoint directory")
    gc.collect()
    fresh = create_backend(name, task_dir=str(root / f"{name}-restored"), options=options)
    t0 = time.perf_counter()
    fresh.restore(last, storage)
    restore_s = time.perf_counter() - t0
    assert [fresh.get(work.keys[i]) for i in probe] == expected, "restored state differs"
    fresh.close()
    result["restore"] = {
        "seconds": restore_s,
        "mb": handle_bytes(last) / MB,
        "mb_per_s": handle_bytes(last) / MB / restore_s,
    }
    if name == "rocksdb":
        say(f"[{name}] local recovery: restart on the same task directory")
        backend.close()
        backend = create_backend(name, task_dir=str(task_dir), options=options)
        t0 = time.perf_counter()
        backend.restore(last, storage)
        local_s = time.perf_counter() - t0
        assert [backend.get(work.keys[i]) for i in probe] == expected, "restored state differs"
        stats = getattr(backend, "last_restore", None)
        result["local_recovery"] = {
            "seconds": local_s,
            "mb_per_s": handle_bytes(last) / MB / local_s,
            "reused_mb": (stats.reused_bytes if stats else 0) / MB,
            "downloaded_mb": (stats.downloaded_bytes if stats else 0) / MB,
        }
        settle(backend)

    first_id = last_id + 1
    # Throughput of the task while a full checkpoint materializes (into an empty storage, so
    # every byte is uploaded), against steady state measured just before and after.
    say(f"[{name}] put throughput: steady vs while a full checkpoint materializes")
    steady: list[float] = []
    during: list[float] = []
    for rep in range(5):
        # Paired windows (steady right before each materialization) cancel out the drift of
        # a machine shared with other work.
        steady.append(measure_puts(backend, work, seconds=1.0))
        scratch = root / f"{name}-scratch-{rep}"
        snap = backend.snapshot(first_id + rep)
        thread = threading.Thread(
            target=_materialize_into,
            args=(snap, CheckpointStorage(str(scratch)), task, first_id + rep),
        )
        thread.start()
        during.append(measure_puts(backend, work, until=thread))
        thread.join()
        shutil.rmtree(scratch, ignore_errors=True)
    ratios = [d / s for d, s in zip(during, steady, strict=True)]
    result["steady_puts_per_s"] = statistics.fmean(steady)
    result["puts_per_s_during_materialize"] = statistics.fmean(during)
    result["throughput_ratio"] = statistics.median(ratios)
    result["throughput_ratios"] = ratios
    backend.close()
    result["last_checkpoint_id"] = last_id
    return result


def _materialize_into(
    snapshot: Any, storage: CheckpointStorage, task: str, checkpoint_id: int
) -> None:
    try:
        snapshot.materialize(storage, directory(task, checkpoint_id))
    finally:
        snapshot.release()


def settle(backend: KeyedStateBackend, timeout: float = 120.0) -> None:
    """Wait until RocksDB's flushes and compactions are done (a quiet start for measurements)."""
    db = getattr(backend, "db", None)
    if db is None:
        return
    deadline = time.monotonic() + timeout
    props = (
        "rocksdb.num-running-compactions",
        "rocksdb.compaction-pending",
        "rocksdb.num-running-flushes",
        "rocksdb.mem-table-flush-pending",
    )
    while time.monotonic() < deadline and any(db.property_int_value(p) for p in props):
        time.sleep(0.05)


def measure_puts(
    backend: KeyedStateBackend,
    work: Workload,
    *,
    seconds: float = 0.0,
    until: threading.Thread | None = None,
    batch: int = 5000,
) -> float:
    """Puts per second of random keys, for ``seconds`` or while ``until`` is alive."""
    keys = work.keys
    n = len(keys)
    rng = random.Random(11)
    done = 0
    version = 10_000
    put = backend.put
    started = time.perf_counter()
    while True:
        base = rng.randrange(n)
        for j in range(batch):
            i = (base + j * 7919) % n
            put(keys[i], work.value(i, version))
        done += batch
        elapsed = time.perf_counter() - started
        if until is not None:
            if not until.is_alive():
                break
        elif elapsed >= seconds:
            break
    return done / (time.perf_counter() - started)


# ------------------------------------------------------------------ report
def verdicts(r: dict[str, Any]) -> dict[str, bool]:
    return {
        "incremental_ratio": r["incremental"]["first_ratio"] <= TARGETS["incremental_ratio"],
        "pause_p99_ms": r["pause_ms"]["p99"] <= TARGETS["pause_p99_ms"],
        "throughput_ratio": r["throughput_ratio"] >= TARGETS["throughput_ratio"],
        "restore_mb_s": r["restore"]["mb_per_s"] >= TARGETS["restore_mb_s"],
    }


def rows(results: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    def cell(r: dict[str, Any], fn: Callable[[dict[str, Any]], Any]) -> str:
        try:
            return str(fn(r))
        except (KeyError, TypeError):
            return "-"

    spec: list[tuple[str, str, Callable[[dict[str, Any]], Any]]] = [
        ("keys / logical MB", "", lambda r: f"{r['keys']:,} / {r['logical_mb']:.0f}"),
        ("load (puts/s)", "", lambda r: f"{r['keys'] / r['load_s']:,.0f}"),
        ("full checkpoint MB", "", lambda r: f"{r['full_checkpoint']['mb']:.1f}"),
        (
            "full checkpoint materialize s",
            "",
            lambda r: f"{r['full_checkpoint']['materialize_s']:.2f}",
        ),
        (
            "incremental after 1% (first) MB",
            "",
            lambda r: f"{r['incremental']['first_bytes'] / MB:.2f}",
        ),
        ("  ratio to full", "<= 10%", lambda r: f"{r['incremental']['first_ratio']:.1%}"),
        ("incremental, mean of N MB", "", lambda r: f"{r['incremental']['mean_bytes'] / MB:.2f}"),
        ("  ratio to full", "", lambda r: f"{r['incremental']['mean_ratio']:.1%}"),
        ("incremental, max of N MB", "", lambda r: f"{r['incremental']['max_bytes'] / MB:.2f}"),
        (
            "incremental materialize s (mean)",
            "",
            lambda r: f"{r['incremental']['materialize_s_mean']:.3f}",
        ),
        ("sync pause p50 ms", "", lambda r: f"{r['pause_ms']['p50']:.1f}"),
        ("sync pause p99 ms", "<= 50", lambda r: f"{r['pause_ms']['p99']:.1f}"),
        (
            "sync pause (full checkpoint) ms",
            "",
            lambda r: f"{r['full_checkpoint']['pause_ms']:.1f}",
        ),
        ("steady puts/s", "", lambda r: f"{r['steady_puts_per_s']:,.0f}"),
        ("puts/s while materializing", "", lambda r: f"{r['puts_per_s_during_materialize']:,.0f}"),
        ("  ratio (median of 5 paired)", ">= 80%", lambda r: f"{r['throughput_ratio']:.0%}"),
        ("restore MB", "", lambda r: f"{r['restore']['mb']:.1f}"),
        ("restore s (from storage dir)", "", lambda r: f"{r['restore']['seconds']:.2f}"),
        ("restore MB/s", ">= 100", lambda r: f"{r['restore']['mb_per_s']:.0f}"),
        ("local recovery s", "", lambda r: f"{r['local_recovery']['seconds']:.2f}"),
        (
            "local recovery reused / downloaded MB",
            "",
            lambda r: (
                f"{r['local_recovery']['reused_mb']:.1f} / "
                f"{r['local_recovery']['downloaded_mb']:.1f}"
            ),
        ),
        (
            "stored MB after retention (keep 2)",
            "",
            lambda r: f"{r['stored_mb_after_retention']:.1f}",
        ),
    ]
    return [(label, target, *(cell(r, fn) for r in results)) for label, target, fn in spec]


def print_table(results: list[dict[str, Any]], checkpoints: int) -> None:
    headers = ("metric", "target", *(r["backend"] for r in results))
    body = [tuple(c.replace(" of N", f" of {checkpoints}") for c in row) for row in rows(results)]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(x)) for x in col) for col in zip(headers, *body, strict=True)]
        for row in (headers, *body):
            print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
        return
    table = Table(title="Snapline state backends")
    for h in headers:
        table.add_column(h, justify="left" if h in ("metric", "target") else "right")
    for row in body:
        table.add_row(*row)
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.state_benchmark", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument(
        "--checkpoints",
        type=int,
        default=20,
        help="incremental checkpoints (1%% updates each) for pauses and sizes",
    )
    parser.add_argument("--backends", default="rocksdb,memory")
    parser.add_argument("--dir", help="working directory (default: a temporary one, deleted)")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="a rocksdb option, e.g. --option write_buffer_bytes=33554432",
    )
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    options: dict[str, Any] = {}
    for item in args.option:
        name, _, value = item.partition("=")
        options[name] = int(value) if value.lstrip("-").isdigit() else value

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="snapline-state-bench-"))
    root.mkdir(parents=True, exist_ok=True)

    def say(message: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)

    load_before = os.getloadavg()
    say(f"generating {args.keys:,} keys (load average {load_before[0]:.1f})")
    work = Workload(args.keys)
    results = []
    try:
        for name in args.backends.split(","):
            backend_options = options if name == "rocksdb" else {}
            work.rng.seed(7)
            results.append(run_backend(name, work, root, args.checkpoints, backend_options, say))
            gc.collect()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    for r in results:
        r["targets_met"] = verdicts(r)
    print_table(results, args.checkpoints)
    say(
        f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} "
        f"(cores: {os.cpu_count()})"
    )
    report = {
        "benchmark": "state",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "command": " ".join(
            ["python -m benchmarks.state_benchmark", *(sys.argv[1:] if argv is None else argv)]
        ),
        "targets": TARGETS,
        # Other work on the machine skews pauses and throughput: recorded for the reader.
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "results": results,
    }
    if len(results) == 2:
        rocks, memory = results
        report["ratios_rocksdb_to_memory"] = {
            "steady_puts": rocks["steady_puts_per_s"] / memory["steady_puts_per_s"],
            "checkpoint_bytes_after_1pct": rocks["incremental"]["first_bytes"]
            / memory["incremental"]["first_bytes"],
            "pause_p99": rocks["pause_ms"]["p99"] / memory["pause_ms"]["p99"],
            "restore_s": rocks["restore"]["seconds"] / memory["restore"]["seconds"],
        }
    if not args.no_json:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        out = RESULTS_DIR / f"state-{datetime.now(UTC):%Y-%m-%d}.json"
        out.write_text(json.dumps(report, indent=2))
        say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
