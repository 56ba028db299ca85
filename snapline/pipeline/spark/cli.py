"""``snapline spark run``: a bounded run of a pipeline on Spark (see ``bounded``).

Threads: the CLI's main thread (the Spark driver).
"""

from __future__ import annotations

import os
import sys

import click

from snapline.pipeline.cli_help import FullSummaryGroup
from snapline.pipeline.errors import SnaplineError


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
    help="Where to stop (exclusive): latest (the end offsets when the run starts) or JSON.",
)
@click.option("--master", default="local[*,4]", show_default=True, help="Spark master URL.")
@click.option(
    "--savepoint-out",
    default=None,
    help="Where the run writes its savepoint at the end offsets (default under the job's "
    "checkpoint dir); `snapline run --from-savepoint` continues from it.",
)
@click.option("--run-id", default=None, help="Re-run a crashed run exactly-once with its id.")
@click.option("--bootstrap-servers", envvar="SNAPLINE_BOOTSTRAP_SERVERS", required=True)
@click.option("--checkpoint-dir", envvar="SNAPLINE_CHECKPOINT_DIR", default=None)
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
            progress=lambda message: click.echo(f"[spark] {message}", err=True),
        )
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc
    rate = result.source_records / result.seconds if result.seconds else 0.0
    click.echo(
        f"[spark] run {result.run_id}: {result.source_records} source records in "
        f"{result.seconds:.1f}s ({rate:,.0f}/s)",
        err=True,
    )
    click.echo(result.savepoint)
