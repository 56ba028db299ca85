"""Savepoint benchmark: writing a savepoint of N keys of keyed state and restoring it with a
different parallelism, through the same code ``snapline savepoint`` and ``--from-savepoint``
use (restore the committed checkpoint, export by operator and key-group range to Parquet;
read the key-group range of each new task, load its backend, snapshot it as a checkpoint).
Kafka is not involved: the numbers are the state's. Each phase runs as many tasks at a time as
snapline would (``--processes`` to choose; threads of this process first, see
``snapline.pipeline.savepoint.pool``); after the timed restore, every new
checkpoint is read back and checked key by key (not timed).

    python -m benchmarks.savepoint_benchmark [--keys 1000000] [--backend rocksdb|memory]

Prints a table and writes ``benchmarks/results/savepoint-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from benchmarks.state_benchmark import Workload
from snapline.pipeline.checkpoint.metadata import CheckpointRef, TaskCheckpoint
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.keygroups import (
    key_group,
    key_group_of_state_key,
    key_group_range,
    state_key_prefix,
)
from snapline.pipeline.savepoint.export import ExportJob, export_task
from snapline.pipeline.savepoint.format import OperatorState
from snapline.pipeline.savepoint.pool import LOCAL_THREADS, pool_size, run_jobs
from snapline.pipeline.savepoint.restore import LoadJob, StateMapping, load_task
from snapline.pipeline.state import create_backend

MB = 1024 * 1024
MAX_PARALLELISM = 128


def cpu_seconds() -> float:
    """CPU time of this process's threads and of its finished child processes (the pool's,
    which a phase joins before it ends): what a phase costs apart from waiting for the CPU
    on a busy machine."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run(
    keys: int,
    backend_name: str,
    old_tasks: int,
    new_tasks: int,
    tmp: Path,
    processes: int | None = None,
    threads: int = LOCAL_THREADS,
) -> dict[str, Any]:
    work = Workload(keys)
    storage = CheckpointStorage(str(tmp / "checkpoints"))
    states = [{"name": "total", "kind": "value", "serde": "json", "id": 1, "operator": 1}]
    # The job's checkpoints: `old_tasks` tasks, each owning its key-group range.
    checkpoints = []
    state_bytes = 0
    backends = [
        create_backend(backend_name, task_dir=str(tmp / f"old-{i}"), options={})
        for i in range(old_tasks)
    ]
    for i in range(keys):
        kb = f"customer-{i:09d}".encode()
        group = key_group(kb, MAX_PARALLELISM)
        task = group * old_tasks // MAX_PARALLELISM
        value = orjson.dumps(work.value(i, 0).hex()[:120])
        backends[task].put(state_key_prefix(group, kb) + b"\x01", value)
        state_bytes += len(kb) + len(value)
    for i, backend in enumerate(backends):
        ref = CheckpointRef(1, "bench")
        snap = backend.snapshot(1)
        handle = snap.materialize(storage, ref.directory("bench", f"s1-p{i}"))
        snap.release()
        meta = TaskCheckpoint("bench", f"s1-p{i}", ref, "bench", {}, handle, states=states)
        meta.write(storage)
        checkpoints.append(meta)
        backend.close()

    # Savepoint write: restore each committed checkpoint, export it to Parquet.
    checkpoint_bytes = sum(f.size for meta in checkpoints if meta.state for f in meta.state.files)
    export_jobs = []
    for i, meta in enumerate(checkpoints):
        groups = key_group_range(i, old_tasks, MAX_PARALLELISM)
        export_jobs.append(
            ExportJob(
                job="bench",
                task_id=meta.task_id,
                ref=meta.ref,
                checkpoint_dir=storage.uri,
                target=str(tmp / "savepoint"),
                scratch=str(tmp / f"scratch-{i}"),
                backend=backend_name,
                backend_options={},
                operator_uids={1: "RunningTotal"},
                partition=i,
                key_groups=(groups.start, groups.stop - 1),
            )
        )
    write_processes = pool_size(len(export_jobs), state_bytes=checkpoint_bytes, processes=processes)
    started, cpu = time.perf_counter(), cpu_seconds()
    exported = run_jobs(export_task, export_jobs, write_processes, threads=threads)
    write_s = time.perf_counter() - started
    write_cpu_s = cpu_seconds() - cpu
    files = [e.files["RunningTotal"] for e in exported]
    savepoint_bytes = sum(f.size for f in files)

    # Restore with rescale: each new task loads its key-group range and checkpoints it.
    operator = OperatorState("RunningTotal", "keyed", states, files)
    mapping = {("RunningTotal", "total"): StateMapping("RunningTotal", "total", 1, 1)}
    topic = "bench.repartition"
    new_ref = CheckpointRef(2, "bench")
    load_jobs = [
        LoadJob(
            backend=backend_name,
            backend_options={},
            scratch=str(tmp / f"new-{p}"),
            savepoint_uri=str(tmp / "savepoint"),
            operators=[operator],
            mapping=mapping,
            partition=p,
            partitions={topic: new_tasks},
            reads=(topic,),
            max_parallelism=MAX_PARALLELISM,
            checkpoint_dir=storage.uri,
            directory=new_ref.directory("bench", f"new-p{p}"),
            checkpoint_id=2,
        )
        for p in range(new_tasks)
    ]
    restore_processes = pool_size(
        len(load_jobs), rows=sum(f.rows for f in files), processes=processes
    )
    started, cpu = time.perf_counter(), cpu_seconds()
    loaded = run_jobs(load_task, load_jobs, restore_processes, threads=threads)
    restore_s = time.perf_counter() - started
    restore_cpu_s = cpu_seconds() - cpu
    restored_entries = sum(entries for _, entries in loaded)
    assert restored_entries == keys, f"restored {restored_entries} of {keys} entries"

    # Not timed: read every new task's checkpoint back, as a worker's recovery would, and
    # check that it holds exactly the keys of its key-group range, all of them once.
    started = time.perf_counter()
    seen = 0
    for p, (handle, _) in enumerate(loaded):
        reader = create_backend(backend_name, task_dir=str(tmp / f"verify-{p}"), options={})
        reader.restore(handle, storage)
        groups = key_group_range(p, new_tasks, MAX_PARALLELISM)
        for stored, _, _ in reader.items():
            assert key_group_of_state_key(stored) in groups, f"task {p} got a foreign key"
            seen += 1
        reader.close()
    assert seen == keys, f"the new checkpoints hold {seen} of {keys} entries"
    verify_s = time.perf_counter() - started
    return {
        "backend": backend_name,
        "keys": keys,
        "state_mb": state_bytes / MB,
        "savepoint_mb": savepoint_bytes / MB,
        "old_tasks": old_tasks,
        "new_tasks": new_tasks,
        "write_s": write_s,
        "write_mb_per_s": state_bytes / MB / write_s,
        "write_cpu_s": write_cpu_s,
        "restore_s": restore_s,
        "restore_mb_per_s": state_bytes / MB / restore_s,
        "restore_cpu_s": restore_cpu_s,
        "threads": threads,
        "write_processes": write_processes,
        "restore_processes": restore_processes,
        "verify_s": verify_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--backend", action="append", choices=["memory", "rocksdb"])
    parser.add_argument("--old-tasks", type=int, default=4)
    parser.add_argument("--new-tasks", type=int, default=12)
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="jobs at a time per phase: two threads of this process, then pool processes "
        "(default: what snapline uses: one per CPU from 32 MB or 250k rows of state)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=LOCAL_THREADS,
        help=f"of those jobs, how many run in threads of this process (default {LOCAL_THREADS})",
    )
    args = parser.parse_args()
    results = []
    for backend in args.backend or ["memory", "rocksdb"]:
        tmp = Path(tempfile.mkdtemp(prefix="snapline-sp-bench-"))
        try:
            results.append(
                run(
                    args.keys,
                    backend,
                    args.old_tasks,
                    args.new_tasks,
                    tmp,
                    args.processes,
                    args.threads,
                )
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(
        "| backend | keys | state | savepoint files | jobs at once | write | restore "
        f"{args.old_tasks} → {args.new_tasks} tasks | CPU write / restore |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['backend']} | {r['keys']:,} | {r['state_mb']:.0f} MB | "
            f"{r['savepoint_mb']:.0f} MB | {r['write_processes']} / {r['restore_processes']} | "
            f"{r['write_s']:.2f} s = {r['write_mb_per_s']:.0f} MB/s | "
            f"{r['restore_s']:.2f} s = {r['restore_mb_per_s']:.0f} MB/s | "
            f"{r['write_cpu_s']:.2f} s / {r['restore_cpu_s']:.2f} s |"
        )
    out = Path(__file__).parent / "results" / f"savepoint-{time.strftime('%Y%m%d-%H%M')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps({"results": results, "load": os.getloadavg(), "cpus": os.cpu_count()}, indent=2)
    )
    print(f"load average {os.getloadavg()}; wrote {out}")


if __name__ == "__main__":
    main()
