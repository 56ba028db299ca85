"""``snapline savepoint create|from-checkpoint|inspect|list|delete``: savepoints for people.

What they print bypasses the log's redacting filter, so every path or URI goes through
``redact_text``: a default savepoint URI carries the checkpoint dir's credentials.

Threads: the CLI's main thread.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from snapline.connectors.config import redact_text
from snapline.pipeline.cli_help import FullSummaryGroup
from snapline.pipeline.errors import SnaplineError
from snapline.pipeline.progress import progress_bar

console = Console(stderr=True)


def _job(spec: str, bootstrap: str | None, checkpoint_dir: str | None) -> tuple[Any, dict, str]:
    sys.path.insert(0, os.getcwd())
    from snapline.pipeline.graph import load_pipeline

    pipeline = load_pipeline(spec)
    pipeline.validate()
    if not bootstrap:
        raise click.UsageError(
            "savepoints need the job's Kafka cluster: pass --bootstrap-servers or set "
            "SNAPLINE_BOOTSTRAP_SERVERS (for the embedded broker of `snapline run`, the "
            "address it prints: 'embedded Kafka broker at ...')"
        )
    config = {"bootstrap.servers": bootstrap, **pipeline.kafka_config}
    directory = (
        checkpoint_dir or pipeline.checkpoint_dir or os.path.join(".snapline", "checkpoints")
    )
    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.savepoint.markers import use_topic_generations

    use_topic_generations(pipeline, CheckpointStorage(directory))  # its repartition topics
    return pipeline, config, directory


_bootstrap = click.option(
    "--bootstrap-servers",
    envvar="SNAPLINE_BOOTSTRAP_SERVERS",
    default=None,
    help="The job's Kafka cluster (env SNAPLINE_BOOTSTRAP_SERVERS).",
)
_checkpoints = click.option(
    "--checkpoint-dir",
    envvar="SNAPLINE_CHECKPOINT_DIR",
    default=None,
    show_envvar=True,
    help="The job's checkpoint storage (env SNAPLINE_CHECKPOINT_DIR, which keeps credentials "
    "out of ps; default: the pipeline's checkpoint_dir, else .snapline/checkpoints).",
)


@click.group(cls=FullSummaryGroup)
def savepoint() -> None:
    """Savepoints: self-contained, portable snapshots of a job for upgrades and rescaling.

    Default location: <checkpoint dir>/<job>/savepoints/sp-<time>-<id>; checkpoint retention
    never deletes savepoints (``snapline savepoint delete`` does)."""


@savepoint.command()
@click.argument("spec")
@click.option("--path", "target", default=None, help="Where to write it (directory or URI).")
@click.option("--stop", is_flag=True, help="Stop with the savepoint: every worker exits after it.")
@click.option("--timeout", default=120.0, show_default=True, help="Seconds to wait for workers.")
@_bootstrap
@_checkpoints
def create(
    spec: str,
    target: str | None,
    stop: bool,
    timeout: float,
    bootstrap_servers: str | None,
    checkpoint_dir: str | None,
) -> None:
    """Take a savepoint of the running job SPEC (module:attribute) and print its path.

    Every worker commits a checkpoint of everything it has read and pauses (with --stop: exits;
    nothing is output after the savepoint) while the savepoint is written from those
    checkpoints; then the job resumes."""
    from confluent_kafka.admin import AdminClient

    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.savepoint import control
    from snapline.pipeline.savepoint.export import (
        active_members,
        default_savepoint_uri,
        export_savepoint,
        job_tasks,
        topic_partitions,
    )

    pipeline, config, directory = _job(spec, bootstrap_servers, checkpoint_dir)
    admin = AdminClient(config)
    members = active_members(admin, pipeline.name)
    if not members:
        raise click.ClickException(
            f"job {pipeline.name!r} has no running workers; for a stopped job use "
            f"'snapline savepoint from-checkpoint {spec}'"
        )
    target = target or default_savepoint_uri(directory, pipeline.name)
    storage = CheckpointStorage(directory)
    request = control.new_request_id()
    control.ensure_control_topic(config, pipeline.name)
    console.print(f"savepoint {request}: asking {members} workers to commit and pause")
    control.send(config, pipeline.name, "savepoint", request, stop)
    resumed = False
    try:
        # Holds from the request on: a worker that paused first waits for the others too.
        with control.holding(config, pipeline.name, request):
            deadline = time.monotonic() + timeout
            while True:
                acks = control.read_acks(storage, pipeline.name, request)
                failed = {w: a for w, a in acks.items() if a["status"] == "failed"}
                if failed:
                    raise click.ClickException(f"workers could not commit the savepoint: {failed}")
                expected = (
                    max(members, active_members(admin, pipeline.name)) if not stop else members
                )
                if len(acks) >= expected:
                    break
                if time.monotonic() > deadline:
                    raise click.ClickException(
                        f"{len(acks)} of {expected} workers acknowledged within {timeout:.0f}s"
                    )
                time.sleep(0.3)
            partitions = topic_partitions(
                admin,
                pipeline.stages().input_topics(pipeline.source_topics()),
                str(bootstrap_servers),
            )
            covered = {t for a in acks.values() for t in a["tasks"]}
            missing = sorted({t.task_id for t in job_tasks(pipeline, partitions)} - covered)
            if missing:
                raise click.ClickException(
                    f"tasks {missing} were not paused by any worker (a rebalance during the "
                    "savepoint?); try again"
                )
            console.print(
                f"all {len(acks)} workers committed and paused; writing {redact_text(target)}"
            )
            with progress_bar(console) as bar:
                metadata = export_savepoint(
                    pipeline, config, directory, target, origin="savepoint", progress=bar
                )
            if not stop:
                control.send(config, pipeline.name, "resume", request)
                resumed = True
            else:
                deadline = time.monotonic() + 60
                while active_members(admin, pipeline.name) and time.monotonic() < deadline:
                    time.sleep(0.5)
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        if not resumed:
            # With --stop too: it closes the request, so that a worker started from here on
            # (the job restarted from this savepoint) does not take it as in progress.
            try:
                control.send(config, pipeline.name, "resume", request)
            except Exception as exc:  # a cleanup: never hides the outcome or the error
                console.print(
                    f"warning: could not send resume for savepoint {request}: "
                    f"{redact_text(str(exc))}"
                )
    _summary(metadata)
    click.echo(redact_text(target))


@savepoint.command("from-checkpoint")
@click.argument("spec")
@click.option("--path", "target", default=None, help="Where to write it (directory or URI).")
@_bootstrap
@_checkpoints
def from_checkpoint(
    spec: str, target: str | None, bootstrap_servers: str | None, checkpoint_dir: str | None
) -> None:
    """Build a savepoint of the stopped job SPEC from its committed checkpoints."""
    from confluent_kafka.admin import AdminClient

    from snapline.pipeline.savepoint.export import (
        default_savepoint_uri,
        export_savepoint,
        wait_until_stopped,
    )

    pipeline, config, directory = _job(spec, bootstrap_servers, checkpoint_dir)
    members = wait_until_stopped(AdminClient(config), pipeline.name)
    if members:
        raise click.ClickException(
            f"job {pipeline.name!r} is running ({members} workers); its checkpoints move on "
            f"while they are read: use 'snapline savepoint create {spec}'"
        )
    target = target or default_savepoint_uri(directory, pipeline.name)
    try:
        with progress_bar(console) as bar:
            metadata = export_savepoint(
                pipeline,
                config,
                directory,
                target,
                origin="from-checkpoint",
                progress=bar,
                publish_staged=True,
            )
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc
    _summary(metadata)
    click.echo(redact_text(target))


def _summary(metadata: Any) -> None:
    rows = sum(f.rows for op in metadata.operators for f in op.files)
    size = sum(f.size for op in metadata.operators for f in op.files)
    flight = sum(f.rows for x in metadata.in_flight for f in x.files)
    console.print(
        f"savepoint of {metadata.pipeline}: {len(metadata.operators)} operators, {rows} state "
        f"entries ({size / 1e6:.1f} MB), {flight} records in flight"
    )


@savepoint.command()
@click.argument("uri")
def inspect(uri: str) -> None:
    """Print the operators, states, key counts and sizes of the savepoint at URI."""
    import pyarrow.compute as pc

    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.savepoint.format import read_metadata, read_table

    storage = CheckpointStorage(uri)
    try:
        meta = read_metadata(storage)
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc
    out = Console()
    out.print(
        f"[bold]{meta.pipeline}[/bold]  origin {meta.origin}, created "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(meta.created_at))} UTC, "
        f"max_parallelism {meta.max_parallelism}, Snapline {meta.snapline_version}"
    )
    table = Table(title="keyed state")
    for column in (
        "operator",
        "partitioning",
        "state",
        "kind",
        "serde",
        "keys",
        "entries",
        "files",
        "bytes",
    ):
        table.add_column(
            column, justify="right" if column in ("keys", "entries", "files", "bytes") else "left"
        )
    for op in meta.operators:
        counts: dict[str, list[int]] = {}
        for entry in op.files:
            data = read_table(storage, entry).select(["state", "key"])
            for state in op.states:
                rows = data.filter(pc.equal(data.column("state"), state["name"]))
                got = counts.setdefault(state["name"], [0, 0])
                got[0] += len(set(rows.column("key").to_pylist()))
                got[1] += rows.num_rows
        for i, state in enumerate(op.states):
            keys, entries = counts.get(state["name"], [0, 0])
            table.add_row(
                op.uid if i == 0 else "",
                op.partitioning if i == 0 else "",
                state["name"],
                state["kind"],
                state["serde"],
                str(keys),
                str(entries),
                str(len(op.files)) if i == 0 else "",
                str(sum(f.size for f in op.files)) if i == 0 else "",
            )
    out.print(table)
    offsets = Table(title="source offsets (next to read)")
    offsets.add_column("topic")
    offsets.add_column("topic id")
    offsets.add_column("partition", justify="right")
    offsets.add_column("offset", justify="right")
    for topic, parts in sorted(meta.source_offsets.items()):
        for partition, offset in sorted(parts.items()):
            offsets.add_row(
                topic,
                meta.source_topic_ids.get(topic, "") if partition == min(parts) else "",
                str(partition),
                str(offset),
            )
    out.print(offsets)
    for flight in meta.in_flight:
        out.print(
            f"in flight in {flight.topic} ({flight.partitions} partitions): "
            f"{sum(f.rows for f in flight.files)} records"
        )


@savepoint.command("list")
@click.argument("spec")
@_checkpoints
def list_savepoints(spec: str, checkpoint_dir: str | None) -> None:
    """List the savepoints in the job's default savepoint directory."""
    sys.path.insert(0, os.getcwd())
    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.graph import load_pipeline
    from snapline.pipeline.savepoint.format import read_metadata

    pipeline = load_pipeline(spec)
    directory = (
        checkpoint_dir or pipeline.checkpoint_dir or os.path.join(".snapline", "checkpoints")
    )
    root = CheckpointStorage(directory)
    table = Table(title=f"savepoints of {pipeline.name}")
    for column in ("path", "created (UTC)", "origin", "operators", "bytes"):
        table.add_column(column)
    for name in root.list_dir(f"{pipeline.name}/savepoints"):
        if name.startswith("_"):
            continue
        path = root.full_path(f"{pipeline.name}/savepoints/{name}")
        try:
            meta = read_metadata(CheckpointStorage(path))
        except SnaplineError as exc:
            table.add_row(redact_text(path), "", f"incomplete: {redact_text(str(exc))}", "", "")
            continue
        table.add_row(
            redact_text(path),
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(meta.created_at)),
            meta.origin,
            str(len(meta.operators)),
            str(sum(f.size for op in meta.operators for f in op.files)),
        )
    Console().print(table)


def _job_dirs(uri: str, checkpoint_dir: str | None, job: str | None) -> list[str]:
    """The job directories whose restore markers may name the savepoint at ``uri``: the one in
    ``checkpoint_dir`` (when given), and the one the savepoint's default location is in
    (``<checkpoint dir>/<job>/savepoints/<name>``)."""
    found: list[str] = []
    if checkpoint_dir and job:
        found.append(f"{checkpoint_dir.rstrip('/')}/{job}")
    path, _, query = uri.partition("?")
    parts = path.rstrip("/").rsplit("/", 2)
    if (
        len(parts) == 3
        and parts[1] == "savepoints"
        and (job is None or parts[0].rsplit("/", 1)[-1] == job)
    ):
        found.append(parts[0] + (f"?{query}" if query else ""))
    return found


def _restoring_from(job_dir: str, created_at: float | None) -> str | None:
    """The marker of a restore in progress in ``job_dir`` that may be of this savepoint (the
    same ``created_at``, or one that cannot be read), or None."""
    from snapline.pipeline.checkpoint.metadata import decode_checked
    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.savepoint.markers import RESTORING

    storage = CheckpointStorage(job_dir)
    if not storage.exists(RESTORING):
        return None
    what = storage.full_path(RESTORING)
    try:
        marker = decode_checked(storage.read_bytes(RESTORING), what, "savepoint")
    except SnaplineError:
        return what  # unreadable: it may name this one
    if created_at is None or marker.get("created_at") == created_at:
        return what
    return None


@savepoint.command()
@click.argument("uri")
@click.option(
    "--force",
    is_flag=True,
    help="Delete it even while a restore of the job from it is in progress (that restore can "
    "then only be finished from another savepoint).",
)
@_checkpoints
def delete(uri: str, force: bool, checkpoint_dir: str | None) -> None:
    """Delete the savepoint at URI (refused if URI is not a savepoint, or while a restore of
    its job from it is in progress: its marker in the job's directory, found with
    --checkpoint-dir or beside the savepoint's default location, names it)."""
    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.savepoint.format import METADATA_FILE, read_metadata

    storage = CheckpointStorage(uri)
    if not storage.exists(METADATA_FILE):
        raise click.ClickException(
            f"{redact_text(uri)} is not a savepoint (no {METADATA_FILE}); not deleted. What is "
            "left of a savepoint whose deletion was cut short has none either: delete that "
            "directory by hand"
        )
    if not force:
        try:
            meta = read_metadata(storage)
            job, created_at = meta.pipeline, meta.created_at
        except SnaplineError:  # corrupt: its job is known only from where it is
            job, created_at = None, None
        for job_dir in _job_dirs(uri, checkpoint_dir, job):
            marker = _restoring_from(job_dir, created_at)
            if marker is not None:
                raise click.ClickException(
                    f"a restore of job {job or '?'} from this savepoint is in progress "
                    f"({redact_text(marker)}): it stopped after changing Kafka and is finished "
                    f"only by starting a worker with --from-savepoint {redact_text(uri)}. "
                    "Finish it (or restore another savepoint), then delete this one; --force "
                    "deletes it now"
                )
    # The metadata first: a deletion cut short leaves no savepoint that looks complete.
    storage.delete_file(METADATA_FILE)
    storage.delete_dir("")
    click.echo(f"deleted {redact_text(uri)}")
