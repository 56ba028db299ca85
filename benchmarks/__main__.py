"""Command line of the benchmark harness: ``python -m benchmarks run|recovery|handover``."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click
from rich.console import Console

from benchmarks.broker import kafka


def _command_line() -> str:
    return "python -m benchmarks " + shlex.join(sys.argv[1:])


def _console() -> Console:
    # Wide enough for the results table when the output is a log file, not a terminal.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (value or "").split(",") if n.strip())


@click.group()
def cli() -> None:
    """Snapline benchmarks: throughput, latency and recovery against a plain confluent-kafka
    loop and Quix Streams, measured in one run."""


@cli.command()
@click.option("--suite", type=click.Choice(["keyed", "stages"]), default="keyed",
              show_default=True,
              help="keyed: input keyed by customer, one-stage running total; stages: input "
                   "keyed by order id, 2-stage running total (key_by → repartition) vs "
                   "baseline A and Quix group_by")
@click.option("--records", type=int, default=None, help="input records [1,000,000; quick 50,000]")
@click.option("--keys", type=int, default=None, help="distinct customers [100,000; quick 1,000]")
@click.option("--partitions", type=int, default=8, show_default=True)
@click.option("--repetitions", type=int, default=None, help="runs per system [3; quick 1]")
@click.option("--quick", is_flag=True, help="small CI smoke test: no thresholds")
@click.option("--bootstrap-servers", default=None,
              help="an existing Kafka cluster; default: start a local broker")
@click.option("--only", default=None, help="comma-separated systems, e.g. baseline-a,quix")
@click.option("--profile", is_flag=True,
              help="run each system's process under pyinstrument (first repetition)")
@click.option("--keep-workdir", is_flag=True,
              help="keep the work directory (per run: process.log, metrics.jsonl, state)")
@click.option("--no-latency", is_flag=True, help="skip the fixed-rate latency runs")
@click.option("--latency-only", default=None,
              help="comma-separated systems that get a latency run (default: every system); "
                   "the CI smoke test uses one of each kind")
@click.option("--latency-rate", type=float, default=None, help="records/s [5000; quick 2000]")
@click.option("--latency-seconds", type=float, default=None, help="[10; quick 3]")
@click.option("--time-budget", type=float, default=None,
              help="seconds after which remaining runs are skipped [quick: 900; full: none]")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="results JSON path (default benchmarks/results/<date>-<machine>.json; "
                   "quick runs go to benchmarks/results/tmp/ and leave the README alone)")
def run(suite: str, records: int | None, keys: int | None, partitions: int, repetitions: int | None,
        quick: bool, bootstrap_servers: str | None, only: str | None, profile: bool,
        keep_workdir: bool, no_latency: bool, latency_only: str | None,
        latency_rate: float | None, latency_seconds: float | None, time_budget: float | None,
        output: Path | None) -> None:
    """Throughput and latency of every system on the same input.

    Exits 1 when any run FAILED (wrong output, crash, hang), after writing all results.
    """
    from benchmarks.suite import SuiteConfig, any_failed, run_suite, select

    config = SuiteConfig(
        records=records or (50_000 if quick else 1_000_000),
        keys=keys or (1_000 if quick else 100_000),
        repetitions=repetitions or (1 if quick else 3),
        partitions=partitions,
        quick=quick,
        only=_names(only),
        profile=profile,
        keep_workdir=keep_workdir,
        latency=not no_latency,
        latency_only=_names(latency_only),
        latency_rate=latency_rate or (2_000.0 if quick else 5_000.0),
        latency_seconds=latency_seconds or (3.0 if quick else 10.0),
        output=output,
        command=_command_line(),
        time_budget=time_budget or (900.0 if quick else None),
        suite=suite,
    )
    try:
        select(config.only, config.suite)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--only") from None
    try:
        select(config.latency_only, config.suite)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--latency-only") from None
    console = _console()
    with kafka(bootstrap_servers) as bootstrap:
        payload = run_suite(config, bootstrap, console)
    if any_failed(payload):
        sys.exit(1)  # everything is written; the exit code tells CI a run failed


@cli.command()
@click.option("--keys", type=int, default=None,
              help="keys of state, ~150 B each [1,000,000 ≈ 150 MB; quick 20,000]")
@click.option("--quick", is_flag=True, help="small smoke test")
@click.option("--bootstrap-servers", default=None,
              help="an existing Kafka cluster; default: start a local broker")
@click.option("--only", default=None,
              help="comma-separated: snapline-rocksdb,snapline-rocksdb-local,snapline-memory,"
                   "quix-changelog,quix-local")
@click.option("--partitions", type=int, default=8, show_default=True)
@click.option("--restarts", type=int, default=None,
              help="SIGKILL → restart cycles per system [5; quick 2]")
@click.option("--output", type=click.Path(path_type=Path), default=None)
def recovery(keys: int | None, quick: bool, bootstrap_servers: str | None, only: str | None,
             partitions: int, restarts: int | None, output: Path | None) -> None:
    """Time from restarting a SIGKILLed worker to its first new committed output."""
    from benchmarks.recovery import RecoveryConfig, run_recovery, select_recovery

    config = RecoveryConfig(
        keys=keys or (20_000 if quick else 1_000_000),
        quick=quick,
        only=_names(only),
        partitions=partitions,
        output=output,
        command=_command_line(),
        restarts=restarts or (2 if quick else 5),
    )
    try:
        select_recovery(config.only)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--only") from None
    console = _console()
    with kafka(bootstrap_servers) as bootstrap:
        run_recovery(config, bootstrap, console)


def _kafka_settings(values: tuple[str, ...]) -> dict[str, str]:
    settings: dict[str, str] = {}
    for value in values:
        key, sep, setting = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not KEY=VALUE", param_hint="--kafka-config")
        settings[key.strip()] = setting.strip()
    return settings


@cli.command()
@click.option("--keys", type=int, default=None,
              help="keys of state, ~150 B each [100,000; quick 5,000]")
@click.option("--partitions", type=int, default=8, show_default=True)
@click.option("--repetitions", type=int, default=None, help="kills, one per fresh job [3; quick 1]")
@click.option("--rate", type=float, default=1_000.0, show_default=True,
              help="input records/s while the worker is killed")
@click.option("--warmup", type=float, default=5.0, show_default=True,
              help="seconds of steady input before the kill")
@click.option("--after-kill", type=float, default=None,
              help="seconds of input after the kill [90; quick 30]")
@click.option("--kafka-config", multiple=True, metavar="KEY=VALUE",
              help="librdkafka setting of both workers, e.g. transaction.timeout.ms=10000")
@click.option("--quick", is_flag=True, help="small smoke test (results go to results/tmp/)")
@click.option("--bootstrap-servers", default=None,
              help="an existing Kafka cluster; default: start a local broker")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="results JSON [benchmarks/results/<date>-<machine>-handover.json]")
def handover(keys: int | None, partitions: int, repetitions: int | None, rate: float,
             warmup: float, after_kill: float | None, kafka_config: tuple[str, ...],
             quick: bool, bootstrap_servers: str | None, output: Path | None) -> None:
    """Time from SIGKILLing one of two workers (never restarted) until the survivor's output
    for the dead worker's partitions is committed and visible."""
    from benchmarks.handover import HandoverConfig, run_handover

    config = HandoverConfig(
        keys=keys or (5_000 if quick else 100_000),
        partitions=partitions,
        repetitions=repetitions or (1 if quick else 3),
        rate=rate,
        warmup_s=warmup,
        after_kill_s=after_kill or (30.0 if quick else 90.0),
        kafka_config=_kafka_settings(kafka_config),
        output=output,
        command=_command_line(),
        quick=quick,
    )
    console = _console()
    with kafka(bootstrap_servers) as bootstrap:
        payload = run_handover(config, bootstrap, console)
    if any(r["status"] != "ok" for r in payload["results"]):
        sys.exit(1)


if __name__ == "__main__":
    cli()
