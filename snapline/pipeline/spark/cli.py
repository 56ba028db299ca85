"""``snapline spark run``: a bounded run of a pipeline on Spark (see ``bounded``);
``snapline spark stream``: a continuous Structured Streaming query (see ``stream``).

Threads: the CLI's main thread (the Spark driver).
"""

from __future__ import annotations

import os
import sys

import click

from snapline.connectors.config import redact_text
from snapline.pipeline.cli_help import FullSummaryGroup
from snapline.pipeline.errors import SnaplineError

_bootstrap = click.option(
    "--bootstrap-servers",
    envvar="SNAPLINE_BOOTSTRAP_SERVERS",
    required=True,
    help="Kafka bootstrap servers (env SNAPLINE_BOOTSTRAP_SERVERS); for the embedded broker, "
    "the address `snapline run` prints.",
)
_checkpoints = click.option(
    "--checkpoint-dir",
    envvar="SNAPLINE_CHECKPOINT_DIR",
    default=None,
    help="The job's checkpoint directory or URI (env SNAPLINE_CHECKPOINT_DIR; default: the "
    "pipeline's checkpoint_dir, else .snapline/checkpoints).",
)


@click.group(cls=FullSummaryGroup)
def spark() -> None:
    """Run the same pipeline module on Spark (PySpark)."""


@spark.command("run")
@click.argument("spec")
@click.option(
    "--from",
    "start",
    default="earliest",
    show_default=True,
    help="Where to start: earliest, savepoint:URI (state and offsets of a savepoint), or JSON "
    'offsets like {"orders": {"0": 1200}}.',
)
@click.option(
    "--to",
    "end",
    default="latest",
    show_default=True,
    help="Where to stop (exclusive): latest (the end offsets when the run first starts; a "
    "re-run with --run-id keeps its recorded range) or JSON.",
)
@click.option("--master", default="local[*,4]", show_default=True, help="Spark master URL.")
@click.option(
    "--savepoint-out",
    default=None,
    help="Where the run writes its savepoint at the end offsets (default under the job's "
    "checkpoint dir); `snapline run --from-savepoint` continues from it.",
)
@click.option("--run-id", default=None, help="Re-run a crashed run exactly-once with its id.")
@_bootstrap
@_checkpoints
def run(
    spec: str,
    start: str,
    end: str,
    master: str,
    savepoint_out: str | None,
    run_id: str | None,
    bootstrap_servers: str,
    checkpoint_dir: str | None,
) -> None:
    """Run the pipeline SPEC over a bounded offset range on Spark, exactly-once into its sinks,
    ending with a savepoint for the services to continue from."""
    sys.path.insert(0, os.getcwd())
    from snapline.pipeline.graph import load_pipeline
    from snapline.pipeline.spark.bounded import run_bounded

    pipeline = load_pipeline(spec)
    directory = (
        checkpoint_dir or pipeline.checkpoint_dir or os.path.join(".snapline", "checkpoints")
    )
    try:
        result = run_bounded(
            spec,
            {"bootstrap.servers": bootstrap_servers, **pipeline.kafka_config},
            directory,
            start=start,
            end=end,
            master=master,
            savepoint_out=savepoint_out,
            run_id=run_id,
            progress=lambda message: click.echo(f"[spark] {redact_text(message)}", err=True),
        )
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc
    rate = result.source_records / result.seconds if result.seconds else 0.0
    click.echo(
        f"[spark] run {result.run_id}: {result.source_records} source records in "
        f"{result.seconds:.1f}s ({rate:,.0f}/s)",
        err=True,
    )
    # Printed, not logged: no redacting filter on the way, and the default savepoint URI
    # carries the checkpoint dir's credentials (passed in the environment, out of `ps`).
    click.echo(redact_text(result.savepoint))


@spark.command("stream")
@click.argument("spec")
@click.option(
    "--checkpoint-location",
    required=True,
    help="Spark's checkpoint location of the query (offsets, commits, state store); restart "
    "with the same location to continue exactly-once.",
)
@click.option(
    "--trigger",
    default="processing-time=5s",
    show_default=True,
    help="processing-time=<n>s|<n>ms (a micro-batch every interval) or available-now "
    "(what is there at start, then stop).",
)
@click.option("--master", default="local[2]", show_default=True, help="Spark master URL.")
@click.option(
    "--max-records-per-batch",
    type=int,
    default=None,
    help="Bound of the source records of one micro-batch (Spark's maxOffsetsPerTrigger).",
)
@click.option(
    "--state-partitions",
    type=int,
    default=4,
    show_default=True,
    help="Partitions of the keyed state (fixed by the query's first run).",
)
@_bootstrap
@_checkpoints
def stream(
    spec: str,
    checkpoint_location: str,
    trigger: str,
    master: str,
    max_records_per_batch: int | None,
    state_partitions: int,
    bootstrap_servers: str,
    checkpoint_dir: str | None,
) -> None:
    """Run the pipeline SPEC continuously as a Spark Structured Streaming query, exactly-once
    into its sinks across restarts from its checkpoint location."""
    sys.path.insert(0, os.getcwd())
    import logging

    from snapline.pipeline.graph import load_pipeline
    from snapline.pipeline.spark.stream import Trigger, run_stream

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from snapline.connectors.config import install_redaction

    install_redaction()

    try:
        pipeline = load_pipeline(spec)
        directory = (
            checkpoint_dir or pipeline.checkpoint_dir or os.path.join(".snapline", "checkpoints")
        )
        run_stream(
            spec,
            {"bootstrap.servers": bootstrap_servers, **pipeline.kafka_config},
            directory,
            checkpoint_location,
            trigger=Trigger.parse(trigger),
            master=master,
            max_records_per_batch=max_records_per_batch,
            state_partitions=state_partitions,
            progress=lambda message: click.echo(f"[spark] {redact_text(message)}", err=True),
        )
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc
