"""The ``snapline`` command: run pipelines, manage the embedded broker, inspect checkpoints.

Exit codes of ``snapline run``: 0 after a stop; 78 (EX_CONFIG) on a configuration error (a
missing topic, a bad setting: restarting cannot help; the message says what to fix); 75
(EX_TEMPFAIL) when a worker asks to be restarted; 79 (EX_SUPERSEDED) when a later process with
the worker's id took over elsewhere; 1 on other errors. The supervisor
(``--workers``) acts on them: see ``snapline.pipeline.supervisor``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import click

from snapline.connectors.config import install_redaction, redact_text
from snapline.pipeline.cli_help import FullSummaryGroup, click_error
from snapline.pipeline.errors import ConfigurationError, SnaplineError
from snapline.pipeline.runtime.liveness import DEFAULT_TIMEOUT as DEFAULT_LIVENESS_TIMEOUT
from snapline.pipeline.runtime.liveness import check_timeout as check_liveness_timeout
from snapline.pipeline.runtime.metrics import DEFAULT_METRICS_HOST
from snapline.pipeline.supervisor import EX_TEMPFAIL, hand_over_message

log = logging.getLogger("snapline.pipeline.cli")  # also when run as __main__


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s",
    )
    install_redaction()  # credentials in a checkpoint URI or a DSN never reach the log


def _configuration_error(exc: ConfigurationError) -> NoReturn:
    """Exit EX_CONFIG with the message: printed here, or, in a supervised worker, handed to
    the supervisor, which stops the job and prints it once for all its workers. A worker
    replaced by a later process with its id exits EX_SUPERSEDED instead (the supervisor
    stops only that worker)."""
    from snapline.pipeline.runtime.incarnation import exit_code_of

    code = exit_code_of(exc)
    if hand_over_message(redact_text(str(exc))):
        log.error("configuration error: exiting with %d (the supervisor prints why)", code)
        sys.exit(code)
    raise click_error(str(exc), code)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@click.group(
    cls=FullSummaryGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(package_name="snapline", prog_name="snapline")
def main() -> None:
    """Snapline: exactly-once stream pipelines on Apache Kafka.

    Start with `snapline run module:pipeline`; `snapline COMMAND --help` explains each
    command."""
    install_redaction()  # every command's uncaught tracebacks too (logging adds its own)


@main.command(short_help="Run a pipeline as one or more worker processes.")
@click.argument("spec")
@click.option(
    "--workers",
    type=int,
    default=1,
    show_default=True,
    help="Worker processes to run on this host (each a consumer-group member). A supervisor "
    "restarts crashed ones.",
)
@click.option(
    "--bootstrap-servers",
    envvar="SNAPLINE_BOOTSTRAP_SERVERS",
    show_envvar=True,
    default=None,
    show_default="an embedded local broker",
    help="Kafka bootstrap servers. Without it, an embedded local broker is used whose data "
    "lives beside a local checkpoint dir (its parent's kafka/: .snapline/kafka by default, and "
    "for a checkpoint URI): it restarts on the same port with the same topics, offsets and "
    "cluster id, so a stopped job continues where it stopped. A broker started with `snapline "
    "kafka start --data-dir` on that directory is reused.",
)
@click.option(
    "--checkpoint-dir",
    envvar="SNAPLINE_CHECKPOINT_DIR",
    show_envvar=True,
    default=None,
    show_default="the pipeline's checkpoint_dir, else .snapline/checkpoints",
    help="Checkpoint storage: a directory or a pyarrow.fs URI (s3://, gs://, hdfs://).",
)
@click.option(
    "--worker-id",
    envvar="SNAPLINE_WORKER_ID",
    show_envvar=True,
    default=None,
    show_default="the hostname; with --workers N: ID-0 .. ID-(N-1)",
    help="Stable id of this worker (fences its previous incarnation).",
)
@click.option(
    "--local-dir",
    envvar="SNAPLINE_LOCAL_DIR",
    show_envvar=True,
    default=None,
    show_default="beside a local checkpoint dir, or ~/.cache/snapline/local for a remote or "
    "network-mounted one",
    help="Directory for local state (RocksDB) and local recovery; each worker uses its own "
    "<DIR>/<worker id>, locked while it runs.",
)
@click.option(
    "--restore-latest",
    is_flag=True,
    help="Only when the job's committed offsets are gone (expired, topic recreated) while "
    "committed checkpoints are stored: continue from the newest checkpoint known committed.",
)
@click.option(
    "--reset-state",
    is_flag=True,
    help="Only when the job's committed offsets are gone while committed checkpoints are "
    "stored: delete the checkpoints marked committed and start with empty state at the "
    "starting position.",
)
@click.option(
    "--skip-deleted-records",
    is_flag=True,
    help="When retention deleted source records the job had not read yet: go on from the "
    "partition's log start (logged, a source_records_deleted event) instead of stopping.",
)
@click.option(
    "--read-recreated-topics",
    is_flag=True,
    help="When a source topic was deleted and created again since the job's checkpoint "
    "(or the savepoint of --from-savepoint was taken): "
    "read the new topic from its start, keeping the job's state (logged, a "
    "source_topic_recreated event), instead of stopping.",
)
@click.option(
    "--from-savepoint",
    default=None,
    help="Start the job from this savepoint (once: a restart continues from the job's own "
    "checkpoints). The job must be stopped; keyed stages may change their partitions.",
)
@click.option(
    "--allow-non-restored-state",
    is_flag=True,
    help="With --from-savepoint: drop savepoint state that the pipeline no longer declares.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    envvar="SNAPLINE_METRICS_PORT",
    show_envvar=True,
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (docs/operations.md lists "
    "them). With --workers N, worker i uses PORT+i. 0: any free port (logged).",
)
@click.option(
    "--metrics-host",
    envvar="SNAPLINE_METRICS_HOST",
    show_envvar=True,
    default=DEFAULT_METRICS_HOST,
    show_default=True,
    help="Address the metrics endpoint listens on: 0.0.0.0 every interface (scrapers on other "
    "hosts), 127.0.0.1 this host only.",
)
@click.option(
    "--liveness-timeout",
    type=float,
    envvar="SNAPLINE_LIVENESS_TIMEOUT",
    show_envvar=True,
    default=DEFAULT_LIVENESS_TIMEOUT,
    show_default=True,
    help="Seconds a worker's task thread may make no progress (stuck in user code, a "
    "client, a lock) before the worker writes every thread's stack to its log and exits 75 "
    "to be restarted. Bounded waits (client calls, a broker outage) do not count. 0: off.",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    default="INFO",
    show_default=True,
)
def run(
    spec: str,
    workers: int,
    bootstrap_servers: str | None,
    checkpoint_dir: str | None,
    worker_id: str | None,
    local_dir: str | None,
    restore_latest: bool,
    reset_state: bool,
    skip_deleted_records: bool,
    read_recreated_topics: bool,
    from_savepoint: str | None,
    allow_non_restored_state: bool,
    metrics_port: int | None,
    metrics_host: str,
    liveness_timeout: float,
    log_level: str,
) -> None:
    """Run the pipeline SPEC (module:attribute) as one or more workers.

    Exit codes: 0 stopped; 78 configuration error (fix what the message names; a supervisor
    stops all workers); 75 restart me (a supervisor restarts the worker with backoff);
    1 other errors (restarted with backoff, given up when it fails again after 5 restarts in
    a row without a healthy run).

    Without --bootstrap-servers the job runs on an embedded Kafka broker that behaves like a
    deployment across restarts: its data dir is beside the checkpoints (.snapline/kafka by
    default), it comes back on the same port, and a second run continues from the committed
    checkpoint. If that port is taken by another process, the run stops and says so."""
    liveness_problem = check_liveness_timeout(liveness_timeout)
    if liveness_problem:
        raise click.BadParameter(liveness_problem, param_hint="--liveness-timeout")
    _setup_logging(log_level)
    sys.path.insert(0, os.getcwd())
    from snapline.pipeline.graph import load_pipeline
    from snapline.pipeline.runtime.worker import WorkerSettings, run_worker

    try:
        pipeline = load_pipeline(spec)
        pipeline.validate()
    except ConfigurationError as exc:
        _configuration_error(exc)
    except SnaplineError as exc:
        raise click.ClickException(str(exc)) from exc
    if workers < 1:
        raise click.BadParameter("must be at least 1", param_hint="--workers")
    if restore_latest and reset_state:
        raise click.UsageError("--restore-latest and --reset-state exclude each other; pick one")
    on_missing = "restore-latest" if restore_latest else "reset-state" if reset_state else "fail"
    checkpoint_dir = (
        checkpoint_dir or pipeline.checkpoint_dir or os.path.join(".snapline", "checkpoints")
    )
    broker = None
    if not bootstrap_servers:
        from snapline.connectors.local.embedded import start_embedded_broker

        try:
            embedded = start_embedded_broker(checkpoint_dir)
        except SnaplineError as exc:
            raise click.ClickException(str(exc)) from exc
        broker, bootstrap_servers = embedded.broker, embedded.bootstrap_servers
        click.echo(embedded.description, err=True)
    if from_savepoint:
        from rich.console import Console

        from snapline.pipeline.progress import progress_bar
        from snapline.pipeline.savepoint.restore import seed_from_savepoint

        try:
            with progress_bar(Console(stderr=True)) as bar:
                seed_from_savepoint(
                    pipeline,
                    {"bootstrap.servers": bootstrap_servers, **pipeline.kafka_config},
                    checkpoint_dir,
                    from_savepoint,
                    allow_non_restored=allow_non_restored_state,
                    progress=bar,
                    read_recreated_topics=read_recreated_topics,
                )
        except ConfigurationError as exc:
            _configuration_error(exc)
        except SnaplineError as exc:
            raise click.ClickException(str(exc)) from exc
    base_id = worker_id or WorkerSettings.default_worker_id()
    try:
        if workers == 1 and broker is None:
            settings = WorkerSettings(
                bootstrap_servers,
                base_id,
                checkpoint_dir,
                local_dir or "",
                on_missing,
                skip_deleted_records=skip_deleted_records,
                read_recreated_topics=read_recreated_topics,
                metrics_port=metrics_port,
                metrics_host=metrics_host,
                liveness_timeout=liveness_timeout,
            )
            from snapline.pipeline.runtime.topics import KafkaUnavailableError

            try:
                run_worker(pipeline, settings)
            except ConfigurationError as exc:
                _configuration_error(exc)
            except KafkaUnavailableError as exc:
                # The broker may be down for a while: "restart me", not a configuration error.
                raise click_error(str(exc), EX_TEMPFAIL) from exc
            except SnaplineError as exc:
                raise click.ClickException(str(exc)) from exc
            return
        from snapline.pipeline.supervisor import Supervisor

        ids = [f"{base_id}-{i}" for i in range(workers)] if workers > 1 else [base_id]
        supervisor = Supervisor(
            spec,
            ids,
            [
                "--bootstrap-servers",
                bootstrap_servers,
                "--log-level",
                log_level,
                "--liveness-timeout",
                repr(liveness_timeout),
                "--metrics-host",
                metrics_host,
                *(["--local-dir", local_dir] if local_dir else []),
                *([f"--{on_missing}"] if on_missing != "fail" else []),
                *(["--skip-deleted-records"] if skip_deleted_records else []),
                *(["--read-recreated-topics"] if read_recreated_topics else []),
            ],
            metrics_port=metrics_port,
            # Not on the command line, where any local user reads it (ps): a checkpoint URI
            # can hold credentials.
            extra_env={"SNAPLINE_CHECKPOINT_DIR": checkpoint_dir},
        )
        code = supervisor.run()
        if supervisor.failure_message:
            click.echo(f"Error: {supervisor.failure_message}", err=True)
        sys.exit(code)
    finally:
        if broker is not None:
            broker.stop()


def _register_inspection() -> None:
    from snapline.pipeline.status_cli import checkpoints, status
    from snapline.pipeline.ui.cli import ui

    main.add_command(checkpoints)
    main.add_command(status)
    main.add_command(ui)


_register_inspection()


def _register_savepoints() -> None:
    from snapline.pipeline.savepoint.cli import savepoint
    from snapline.pipeline.spark.cli import spark

    main.add_command(savepoint)
    main.add_command(spark)


_register_savepoints()


def _register_optional() -> None:
    try:
        from snapline.connectors.local.broker_cli import kafka
    except ImportError:
        return
    main.add_command(kafka)


_register_optional()

if __name__ == "__main__":
    main()
