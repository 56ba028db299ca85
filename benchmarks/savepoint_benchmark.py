"""Savepoint benchmark: writing a savepoint of N keys of keyed state and restoring it with a
different parallelism, through the same code ``snapline savepoint`` and ``--from-savepoint``
use (restore the committed checkpoint, export by operator and key-group range to Parquet;
read the key-group range of each new task, load its backend, snapshot it as a checkpoint).
Kafka is not involved: the numbers are the state's.

    python -m benchmarks.savepoint_benchmark [--keys 1000000] [--backend rocksdb|memory]

Prints a table and writes ``benchmarks/results/savepoint-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from benchmarks.state_benchmark import Workload
from snapline.pipeline.checkpoint.metadata import CheckpointRef, TaskCheckpoint
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.keygroups import key_group, key_group_range, state_key_prefix
from snapline.pipeline.savepoint.export import export_task_state
from snapline.pipeline.savepoint.format import OperatorState, write_table
from snapline.pipeline.savepoint.restore import StateMapping, _load_operator
from snapline.pipeline.state import create_backend

MB = 1024 * 1024
MAX_PARALLELISM = 128


class _Pipeline:
    """The slice of a Pipeline that export_task_state reads."""

    def operator_uids(self) -> dict[int, str]:
        return {1: "RunningTotal"}


def run(keys: int, backend_name: str, old_tasks: int, new_tasks: int, tmp: Path) -> dict[str, Any]:
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
    out = CheckpointStorage(str(tmp / "savepoint"))
    started = time.perf_counter()
    files = []
    for i, meta in enumerate(checkpoints):
        scratch = create_backend(backend_name, task_dir=str(tmp / f"scratch-{i}"), options={})
        assert meta.state is not None
        scratch.restore(meta.state, storage)
        table = export_task_state(_Pipeline(), meta, scratch)["RunningTotal"]  # type: ignore[arg-type]
        groups = key_group_range(i, old_tasks, MAX_PARALLELISM)
        files.append(
            write_table(
                out,
                f"operators/RunningTotal/kg-{groups.start:05d}-{groups.stop - 1:05d}.parquet",
                table,
                key_groups=(groups.start, groups.stop - 1),
                partition=i,
            )
        )
        scratch.close()
    write_s = time.perf_counter() - started
    savepoint_bytes = sum(f.size for f in files)

    # Restore with rescale: each new task loads its key-group range and checkpoints it.
    operator = OperatorState("RunningTotal", "keyed", states, files)
    mapping = {("RunningTotal", "total"): StateMapping("RunningTotal", "total", 1, 1)}
    topic = "bench.repartition"
    started = time.perf_counter()
    restored_entries = 0
    for p in range(new_tasks):
        backend = create_backend(backend_name, task_dir=str(tmp / f"new-{p}"), options={})
        _load_operator(
            backend, out, operator, mapping, p, {topic: new_tasks}, (topic,), MAX_PARALLELISM
        )
        restored_entries += sum(1 for _ in backend.items())
        snap = backend.snapshot(2)
        snap.materialize(storage, CheckpointRef(2, "bench").directory("bench", f"new-p{p}"))
        snap.release()
        backend.close()
    restore_s = time.perf_counter() - started
    assert restored_entries == keys, f"restored {restored_entries} of {keys} entries"
    return {
        "backend": backend_name,
        "keys": keys,
        "state_mb": state_bytes / MB,
        "savepoint_mb": savepoint_bytes / MB,
        "old_tasks": old_tasks,
        "new_tasks": new_tasks,
        "write_s": write_s,
        "write_mb_per_s": state_bytes / MB / write_s,
        "restore_s": restore_s,
        "restore_mb_per_s": state_bytes / MB / restore_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--backend", action="append", choices=["memory", "rocksdb"])
    parser.add_argument("--old-tasks", type=int, default=4)
    parser.add_argument("--new-tasks", type=int, default=12)
    args = parser.parse_args()
    results = []
    for backend in args.backend or ["memory", "rocksdb"]:
        tmp = Path(tempfile.mkdtemp(prefix="snapline-sp-bench-"))
        try:
            results.append(run(args.keys, backend, args.old_tasks, args.new_tasks, tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(
        "| backend | keys | state | savepoint files | write | restore "
        f"{args.old_tasks} → {args.new_tasks} tasks |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['backend']} | {r['keys']:,} | {r['state_mb']:.0f} MB | "
            f"{r['savepoint_mb']:.0f} MB | {r['write_s']:.2f} s = {r['write_mb_per_s']:.0f} MB/s | "
            f"{r['restore_s']:.2f} s = {r['restore_mb_per_s']:.0f} MB/s |"
        )
    out = Path(__file__).parent / "results" / f"savepoint-{time.strftime('%Y%m%d-%H%M')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps({"results": results, "load": os.getloadavg(), "cpus": os.cpu_count()}, indent=2)
    )
    print(f"load average {os.getloadavg()}; wrote {out}")


if __name__ == "__main__":
    main()
