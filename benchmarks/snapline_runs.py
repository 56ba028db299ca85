"""The Snapline configurations that are benchmarked and how a worker is launched.

A worker runs as ``python -m benchmarks.snapline_entry run MODULE:FACTORY --bootstrap-servers B
--worker-id 0`` (the ``snapline run`` CLI), with topics and settings passed as ``BENCH_*``
variables that ``benchmarks.snapline_pipelines`` reads.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from benchmarks.systems import System

_ENTRY = "benchmarks.snapline_entry"


def _worker_args(factory: str, workers: int = 1) -> tuple[str, ...]:
    args = (
        "run",
        f"benchmarks.snapline_pipelines:{factory}",
        "--bootstrap-servers",
        "{bootstrap}",
        "--worker-id",
        "0",
    )
    # --workers N: one supervisor process starts N worker processes (ids 0-0 .. 0-(N-1)) that
    # share the job's partitions through the consumer group, as `snapline run --workers N`.
    return (*args, "--workers", str(workers)) if workers > 1 else args


def _system(
    name: str,
    label: str,
    factory: str,
    backend: str,
    guarantee: str,
    mode: str = "total",
    workers: int = 1,
) -> System:
    return System(
        name=name,
        label=label,
        role="snapline",
        module=_ENTRY,
        args=_worker_args(factory, workers),
        mode=mode,
        exactly_once=guarantee == "exactly_once",
        backend=backend,
        guarantee=guarantee,
        notes=f"{factory}, state_backend={backend}, guarantee={guarantee}, checkpoint every 1 s"
        + (f", {workers} worker processes" if workers > 1 else ""),
        # The profiler runs in the process it starts in: a supervisor's workers are children.
        profiles_itself=workers == 1,
    )


SNAPLINE_SYSTEMS: tuple[System, ...] = (
    _system(
        "snapline-map",
        "Snapline stateless map, exactly-once",
        "stateless_map",
        "memory",
        "exactly_once",
        mode="map",
    ),
    _system(
        "snapline-memory",
        "Snapline running total, memory, exactly-once",
        "running_total",
        "memory",
        "exactly_once",
    ),
    _system(
        "snapline-rocksdb",
        "Snapline running total, rocksdb, exactly-once",
        "running_total",
        "rocksdb",
        "exactly_once",
    ),
    _system(
        "snapline-memory-agg",
        "Snapline running total as key_by().aggregate(), memory, exactly-once",
        "running_total_aggregate",
        "memory",
        "exactly_once",
        mode="rolling",
    ),
    _system(
        "snapline-rocksdb-agg",
        "Snapline running total as key_by().aggregate(), rocksdb, exactly-once",
        "running_total_aggregate",
        "rocksdb",
        "exactly_once",
        mode="rolling",
    ),
    _system(
        "snapline-memory-2w",
        "Snapline running total, memory, exactly-once, 2 worker processes",
        "running_total",
        "memory",
        "exactly_once",
        workers=2,
    ),
    _system(
        "snapline-memory-alo",
        "Snapline running total, memory, at-least-once",
        "running_total",
        "memory",
        "at_least_once",
    ),
    _system(
        "snapline-rocksdb-alo",
        "Snapline running total, rocksdb, at-least-once",
        "running_total",
        "rocksdb",
        "at_least_once",
    ),
)


# The stages suite (input keyed by order id): key_by(customer) re-keys through a repartition
# topic, so the running total is a second stage.
SNAPLINE_STAGE_SYSTEMS: tuple[System, ...] = (
    _system(
        "snapline-2stage-memory",
        "Snapline 2-stage running total (key_by → repartition), memory, exactly-once",
        "running_total_two_stages",
        "memory",
        "exactly_once",
    ),
    _system(
        "snapline-2stage-memory-2w",
        "Snapline 2-stage running total, memory, exactly-once, 2 worker processes",
        "running_total_two_stages",
        "memory",
        "exactly_once",
        workers=2,
    ),
    _system(
        "snapline-2stage-rocksdb",
        "Snapline 2-stage running total (key_by → repartition), rocksdb, exactly-once",
        "running_total_two_stages",
        "rocksdb",
        "exactly_once",
    ),
)


def runtime_missing() -> str:
    """Why the Snapline runtime cannot be benchmarked yet, or "" when it can."""
    try:
        pipeline = importlib.import_module("snapline.pipeline")
    except ImportError as exc:
        return f"cannot import snapline.pipeline: {exc}"
    if not hasattr(pipeline, "Pipeline"):
        return "snapline/pipeline/__init__.py does not export Pipeline yet"
    try:
        cli = importlib.import_module("snapline.pipeline.cli")
    except ImportError as exc:
        return f"snapline.pipeline.cli is missing: {exc}"
    if not hasattr(cli, "main"):
        return "snapline.pipeline.cli has no main() yet"
    return ""


METRICS_ENV = "SNAPLINE_METRICS_FILE"


def checkpoint_metrics(path: Path) -> dict[str, list[float]]:
    """Per-checkpoint measurements from the worker's metrics file (JSON lines written when
    ``SNAPLINE_METRICS_FILE`` is set): seconds for ``commit`` (the Kafka transaction commit)
    and ``checkpoint`` (trigger → committed), bytes for ``state_bytes``."""
    out: dict[str, list[float]] = {"commit": [], "checkpoint": [], "state_bytes": [], "failed": []}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("event") == "checkpoint":
            out["commit"].append(float(event.get("commit_ms", 0)) / 1000.0)
            out["checkpoint"].append(float(event.get("total_ms", 0)) / 1000.0)
            out["state_bytes"].append(float(event.get("state_bytes", 0)))
        elif event.get("event") == "checkpoint_failed":
            out["failed"].append(1.0)
    return out
