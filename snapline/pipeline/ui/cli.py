"""``snapline ui SPEC``: serve the job's overview and checkpoint history page.

Threads: the CLI's main thread serves; one thread per request.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from snapline.pipeline.errors import SnaplineError


@click.command(short_help="Serve a web page: job overview and checkpoint history.")
@click.argument("spec")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0: every interface).",
)
@click.option(
    "--checkpoint-dir",
    envvar="SNAPLINE_CHECKPOINT_DIR",
    default=None,
    help="The job's checkpoint storage (env SNAPLINE_CHECKPOINT_DIR; default: the pipeline's "
    "checkpoint_dir, else .snapline/checkpoints).",
)
@click.option(
    "--bootstrap-servers",
    envvar="SNAPLINE_BOOTSTRAP_SERVERS",
    default=None,
    help="The job's Kafka cluster (env SNAPLINE_BOOTSTRAP_SERVERS), for partitions, committed "
    "offsets and lag. Without it the page shows what checkpoint storage holds.",
)
@click.option(
    "--metrics",
    "metrics_urls",
    multiple=True,
    metavar="HOST:PORT",
    help="A worker's metrics endpoint (snapline run --metrics-port), for records/s, lag and "
    "which worker runs which task. Repeat for each worker.",
)
def ui(
    spec: str,
    port: int,
    host: str,
    checkpoint_dir: str | None,
    bootstrap_servers: str | None,
    metrics_urls: tuple[str, ...],
) -> None:
    """Serve a page for the pipeline SPEC (module:attribute) at http://HOST:PORT/: the job
    overview (workers, tasks, partitions, lag, records/s) and the checkpoint history
    (completed, failed and aborted checkpoints with durations and sizes, per task
    sync/alignment/async times, restores and savepoints). Built from checkpoint storage,
    Kafka and the workers' metrics; /api/job.json has the same data as JSON."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from snapline.connectors.config import install_redaction

    install_redaction()
    sys.path.insert(0, os.getcwd())
    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.graph import load_pipeline
    from snapline.pipeline.ui.server import UIServer
    from snapline.pipeline.ui.view import ViewSource

    try:
        pipeline = load_pipeline(spec)
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc
    directory = (
        checkpoint_dir or pipeline.checkpoint_dir or os.path.join(".snapline", "checkpoints")
    )
    config = (
        {"bootstrap.servers": bootstrap_servers, **pipeline.kafka_config}
        if bootstrap_servers
        else None
    )
    source = ViewSource(pipeline, CheckpointStorage(directory), config, list(metrics_urls))
    try:
        server = UIServer(source, host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}; try --port") from exc
    click.echo(f"Snapline UI of job {pipeline.name}: {server.url} (Ctrl-C stops it)", err=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
