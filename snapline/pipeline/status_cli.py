"""``snapline checkpoints`` and ``snapline status``: what checkpoint storage and Kafka say
about a job, as tables for people (rich).

Threads: the CLI's main thread.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from snapline.connectors.config import redact_text
from snapline.pipeline.errors import SnaplineError

_checkpoint_dir = click.option(
    "--checkpoint-dir",
    envvar="SNAPLINE_CHECKPOINT_DIR",
    default=None,
    help="The job's checkpoint storage (env SNAPLINE_CHECKPOINT_DIR; default: the pipeline's "
    "checkpoint_dir, else .snapline/checkpoints).",
)


def _load(spec: str, checkpoint_dir: str | None) -> tuple[Any, Any]:
    sys.path.insert(0, os.getcwd())
    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.graph import load_pipeline

    try:
        pipeline = load_pipeline(spec)
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc
    directory = (
        checkpoint_dir or pipeline.checkpoint_dir or os.path.join(".snapline", "checkpoints")
    )
    try:
        return pipeline, CheckpointStorage(directory)
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc


def _size(n: int) -> str:
    from snapline.pipeline.ui.page import size

    return size(n)


def _ms(timings: dict[str, float], key: str) -> str:
    return f"{timings[key] * 1000:.1f}" if key in timings else "—"


@click.command(short_help="List the stored checkpoints of each task.")
@click.argument("spec")
@_checkpoint_dir
def checkpoints(spec: str, checkpoint_dir: str | None) -> None:
    """List the checkpoints that checkpoint storage holds for each task of the pipeline SPEC
    (module:attribute), newest last.

    \b
    Columns:
      task       the task (one input partition of one stage: p3, s1-p3)
      id         the checkpoint id (grows per task)
      attempt    the writing worker incarnation's token (its directory suffix)
      state      committed: passed the commit point (marker written);
                 complete: metadata durable, commit not (yet) recorded;
                 INCOMPLETE: no readable metadata (a crash mid-write; retention deletes it)
      size       state files the checkpoint references
      sync/align/async ms   the task's synchronous snapshot, trigger-to-barrier alignment
                 and background write, where the worker recorded them
      positions  next offset to read per topic[partition] (the barrier positions)"""
    from snapline.pipeline.checkpoint.metadata import TaskCheckpoint
    from snapline.pipeline.status import stored_checkpoints, stored_task_ids

    pipeline, storage = _load(spec, checkpoint_dir)
    table = Table(title=f"checkpoints of job {pipeline.name} in {redact_text(storage.uri)}")
    for name in ("task", "id", "attempt", "state", "size", "sync ms", "align ms", "async ms"):
        table.add_column(name, justify="right" if name.endswith(("ms", "size", "id")) else "left")
    table.add_column("positions")
    count = 0
    for task_id in stored_task_ids(storage, pipeline.name):
        for c in stored_checkpoints(storage, pipeline.name, task_id):
            count += 1
            positions = ""
            if c.complete:
                meta = TaskCheckpoint.read(storage, pipeline.name, task_id, c.ref)
                positions = ", ".join(
                    f"{t}[{p}]={o}" for (t, p), o in sorted(meta.positions.items())
                )
            state = "committed" if c.committed else "complete" if c.complete else "INCOMPLETE"
            table.add_row(
                task_id,
                str(c.ref.checkpoint_id),
                c.ref.attempt,
                state,
                _size(c.bytes) if c.complete else "—",
                _ms(c.timings, "sync"),
                _ms(c.timings, "alignment"),
                _ms(c.timings, "async"),
                positions or c.error,
            )
    console = Console()
    if count == 0:
        console.print(f"no checkpoints of job {pipeline.name} in {redact_text(storage.uri)}")
        return
    console.print(table)


@click.command(short_help="Committed offsets, lag and last checkpoint per task.")
@click.argument("spec")
@click.option(
    "--bootstrap-servers",
    envvar="SNAPLINE_BOOTSTRAP_SERVERS",
    default=None,
    help="The job's Kafka cluster (env SNAPLINE_BOOTSTRAP_SERVERS).",
)
@_checkpoint_dir
def status(spec: str, bootstrap_servers: str | None, checkpoint_dir: str | None) -> None:
    """Show, per task of the pipeline SPEC, its partitions' committed offsets, end offsets and
    lag (from Kafka) and its last committed checkpoint (from checkpoint storage). Works
    whether or not the job runs; it does not join the job's consumer group.

    \b
    Columns:
      committed  the consumer group's committed offset (the next record to process)
      end        the partition's end offset (high watermark)
      lag        records after the committed offset: not yet covered by a committed
                 checkpoint (counted by reading them when fewer than 1000 offsets behind;
                 beyond that end - committed, which includes transaction markers)
      checkpoint the last committed checkpoint and when it was taken"""
    import datetime as dt

    from snapline.pipeline.status import job_status

    pipeline, storage = _load(spec, checkpoint_dir)
    if not bootstrap_servers:
        raise click.UsageError(
            "status reads the committed offsets from Kafka: pass --bootstrap-servers or set "
            "SNAPLINE_BOOTSTRAP_SERVERS (for the embedded broker of `snapline run`, the "
            "address it prints: 'embedded Kafka broker at ...')"
        )
    config = {"bootstrap.servers": bootstrap_servers, **pipeline.kafka_config}
    try:
        tasks = job_status(pipeline, config, storage)
    except Exception as exc:
        raise click.ClickException(f"cannot read the job's offsets from Kafka: {exc}") from exc
    where = f"Kafka {bootstrap_servers}, storage {redact_text(storage.uri)}"
    table = Table(title=f"job {pipeline.name}: {where}")
    for name in ("task", "partition", "committed", "end", "lag", "checkpoint", "taken"):
        table.add_column(name, justify="right" if name in ("committed", "end", "lag") else "left")
    total_lag = 0
    for task in tasks:
        last = task.last_checkpoint
        checkpoint = "—" if last is None else str(last.ref.checkpoint_id)
        taken = (
            "—"
            if last is None or not last.created_at
            else dt.datetime.fromtimestamp(last.created_at).strftime("%Y-%m-%d %H:%M:%S")
        )
        if not task.partitions:
            table.add_row(task.task_id, "(not in Kafka)", "—", "—", "—", checkpoint, taken)
        for i, p in enumerate(task.partitions):
            lag = p.lag
            total_lag += lag or 0
            table.add_row(
                task.task_id if i == 0 else "",
                f"{p.topic}[{p.partition}]",
                "—" if p.committed < 0 else str(p.committed),
                "—" if p.end < 0 else str(p.end),
                "—" if lag is None else str(lag),
                checkpoint if i == 0 else "",
                taken if i == 0 else "",
            )
    console = Console()
    console.print(table)
    console.print(f"total lag: {total_lag} records over {len(tasks)} tasks")
