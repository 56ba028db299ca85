"""`snapline kafka ...`: start, stop and inspect the local Kafka broker from a shell.

The click group ``kafka`` is mounted by ``snapline.pipeline.cli``;
``python -m snapline.connectors.local.broker_cli`` runs it alone (CI uses its ``fetch`` command).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import click
from rich.console import Console

from snapline.connectors.local.broker import (
    LocalKafkaBroker,
    broker_answers,
    clear_state,
    ensure_kafka_jars,
    jars_are_complete,
    kafka_version,
    libs_dir,
    read_state,
    stop_recorded_broker,
    tail_lines,
    write_state,
)
from snapline.connectors.local.cluster import LocalKafkaCluster
from snapline.pipeline.cli_help import FullSummaryGroup
from snapline.pipeline.errors import BrokerError

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

_VERSION_OPTION = click.option(
    "--kafka-version",
    "version",
    default=None,
    metavar="X.Y.Z",
    help="Kafka release (default: $SNAPLINE_KAFKA_VERSION or the built-in default).",
)


@contextmanager
def _broker_errors() -> Iterator[None]:
    """Show a BrokerError as a message with its fix, not as a traceback."""
    try:
        yield
    except BrokerError as exc:
        raise click.ClickException(str(exc)) from exc


@contextmanager
def _download_progress(version: str) -> Iterator[Callable[[str], None] | None]:
    """A progress callback for the first download: a spinner on a terminal, lines in CI logs."""
    if jars_are_complete(libs_dir(version)):
        yield None
        return
    target = libs_dir(version)
    if err_console.is_terminal:
        with err_console.status(f"Downloading Kafka {version} jars with Maven…") as status:
            count = 0

            def on_terminal(message: str) -> None:
                nonlocal count
                if message.startswith("downloaded"):
                    count += 1
                status.update(f"Downloading Kafka {version} jars ({count} files) — {message}")

            yield on_terminal
        return
    err_console.print(f"Downloading Kafka {version} jars with Maven into {target} (first run)…")

    def on_log(message: str) -> None:
        # Only finished transfers of jars: the lines that carry the bytes.
        if message.startswith("downloaded") and ".jar" in message or message.startswith("[ERROR]"):
            err_console.print(f"  {message}")

    yield on_log


def _jar_summary(libs: Path) -> str:
    jars = list(libs.glob("*.jar"))
    size = sum(p.stat().st_size for p in jars) / 1e6
    return f"{len(jars)} jars, {size:.0f} MB"


@click.group(name="kafka", cls=FullSummaryGroup)
def kafka() -> None:
    """A real Kafka broker (or a small cluster, --brokers) on this machine, for development
    and tests."""


@kafka.command()
@_VERSION_OPTION
def fetch(version: str | None) -> None:
    """Download the broker's jars into the cache (Maven, first run only)."""
    with _broker_errors():
        version = kafka_version(version)
        started = time.monotonic()
        with _download_progress(version) as progress:
            libs = ensure_kafka_jars(version, progress)
        elapsed = time.monotonic() - started
        console.print(f"Kafka {version}: {libs} ({_jar_summary(libs)}, {elapsed:.1f} s)")


@kafka.command()
@_VERSION_OPTION
@click.option("--detach", "-d", is_flag=True, help="Run in the background until `stop`.")
@click.option("--port", type=int, default=None, help="Client port (default: a free one).")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep topics here across restarts (default: a temporary dir, deleted on stop).",
)
@click.option(
    "--timeout", type=float, default=60.0, show_default=True, help="Seconds to wait for startup."
)
@click.option(
    "--brokers",
    type=click.IntRange(1, 9),
    default=1,
    show_default=True,
    help="Nodes (each broker and controller, its own ports and node-<i>/ data dir). With 3 or "
    "more, internal and new topics get 3 replicas and min ISR 2, so one node may be down.",
)
def start(
    version: str | None,
    detach: bool,
    port: int | None,
    data_dir: Path | None,
    timeout: float,
    brokers: int,
) -> None:
    """Start the broker (or a cluster of --brokers N) and print its bootstrap address.

    In the foreground (default) the broker stops with Ctrl-C; with --detach it keeps
    running after this command returns, until `snapline kafka stop`.
    """
    with _broker_errors():
        running = read_state()
        if running is not None:
            err_console.print(
                f"A local Kafka broker is already running at {running.bootstrap_servers} "
                f"(pid {running.pid}); stop it with `snapline kafka stop`."
            )
            console.print(running.bootstrap_servers)
            return
        version = kafka_version(version)
        if brokers > 1:
            if port is not None:
                raise click.UsageError("--port applies to a single broker; drop it with --brokers")
            _start_cluster(version, brokers, detach, data_dir, timeout)
            return
        with _download_progress(version) as progress:
            broker = LocalKafkaBroker(
                version,
                data_dir=data_dir,
                port=port,
                startup_timeout=timeout,
                die_with_parent=not detach,
                progress=progress,
            )
            with err_console.status(f"Starting Kafka {version}…"):
                bootstrap = broker.start()
        write_state(broker.state(detached=detach))
        if detach:
            err_console.print(
                f"Kafka {version} running in the background (pid {broker.pid}); "
                f"log: {broker.log_path}; stop it with `snapline kafka stop`."
            )
            console.print(bootstrap)
            return
        _serve_in_foreground(broker)


def _start_cluster(
    version: str, brokers: int, detach: bool, data_dir: Path | None, timeout: float
) -> None:
    with _download_progress(version) as progress:
        cluster = LocalKafkaCluster(
            brokers,
            version,
            data_dir=data_dir,
            startup_timeout=max(timeout, 120.0),
            die_with_parent=not detach,
            progress=progress,
        )
        with err_console.status(f"Starting a Kafka {version} cluster of {brokers} nodes…"):
            bootstrap = cluster.start()
    first = cluster.node(1)
    record = first.state(detached=detach)
    others = tuple(
        (cluster.node(i).pid or 0, str(cluster.node(i).data_dir)) for i in cluster.node_ids[1:]
    )
    write_state(
        dataclasses.replace(
            record,
            bootstrap_servers=bootstrap,
            temporary=cluster.temporary,
            other_nodes=others,
        )
    )
    if detach:
        err_console.print(
            f"Kafka {version} cluster of {brokers} nodes running in the background (data "
            f"{cluster.data_dir}); stop it with `snapline kafka stop`."
        )
        console.print(bootstrap)
        return
    _serve_in_foreground(cluster)


def _serve_in_foreground(broker: LocalKafkaBroker | LocalKafkaCluster) -> None:
    err_console.print(
        f"Kafka {broker.version} ready (pid {broker.pid}); log: {broker.log_path}. "
        "Press Ctrl-C to stop."
    )
    console.print(broker.bootstrap_servers)
    pid = broker.pid

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while True:
            code = broker.wait(timeout=1.0)
            if code in (0, 143, -signal.SIGTERM):  # `snapline kafka stop` from another shell
                err_console.print("Kafka was stopped.")
                return
            if code is not None:
                lines = "\n  ".join(tail_lines(broker.log_path, 15))
                raise click.ClickException(
                    f"Kafka exited with code {code}. Last lines of {broker.log_path}:\n  {lines}"
                )
    except KeyboardInterrupt:
        err_console.print("Stopping Kafka…")
    finally:
        signal.signal(signal.SIGTERM, previous)
        broker.stop()
        clear_state(pid)


@kafka.command()
@click.option(
    "--timeout", type=float, default=20.0, show_default=True, help="Seconds before SIGKILL."
)
def stop(timeout: float) -> None:
    """Stop the broker started by `snapline kafka start` and wait until it is gone."""
    with _broker_errors():
        with err_console.status("Stopping Kafka…"):
            state = stop_recorded_broker(timeout)
        if state is None:
            console.print("No local Kafka broker is running.")
            return
        console.print(
            f"Stopped Kafka {state.version} at {state.bootstrap_servers} (pid {state.pid})."
        )


@kafka.command()
def status() -> None:
    """Show whether the broker runs, where, and its log; exit code 1 if it does not run."""
    with _broker_errors():
        state = read_state()
    if state is None:
        console.print("No local Kafka broker is running. Start one with `snapline kafka start -d`.")
        sys.exit(1)
    answers = broker_answers(state.bootstrap_servers, timeout=5.0)
    health = "[green]answering[/green]" if answers else "[red]not answering[/red]"
    console.print(f"Kafka {state.version} at {state.bootstrap_servers}: {health}")
    console.print(f"  pid       {state.pid} ({'detached' if state.detached else 'foreground'})")
    console.print(f"  started   {state.started_at}")
    console.print(f"  log       {state.log_path}")
    if state.other_nodes:
        pids = ", ".join(str(pid) for pid, _ in state.other_nodes)
        console.print(f"  nodes     {1 + len(state.other_nodes)} (other pids {pids})")
    kept = "temporary, deleted on stop" if state.temporary else "kept"
    console.print(f"  data dir  {state.data_dir} ({kept})")
    if not answers:
        sys.exit(1)


if __name__ == "__main__":
    kafka(prog_name="python -m snapline.connectors.local.broker_cli")
