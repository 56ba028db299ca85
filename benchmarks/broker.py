"""The Kafka cluster a benchmark runs against: the one given, or a local broker we start."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import click


@contextlib.contextmanager
def kafka(bootstrap: str | None) -> Iterator[str]:
    """Yield bootstrap servers; start (and finally stop) a local broker when none is given."""
    if bootstrap:
        yield bootstrap
        return
    try:
        from snapline.connectors.local.broker import LocalKafkaBroker
    except ImportError as exc:
        raise click.ClickException(
            f"no --bootstrap-servers given and the local broker launcher cannot be imported "
            f"({exc}); pass --bootstrap-servers HOST:PORT of a running Kafka broker"
        ) from exc
    broker = LocalKafkaBroker()
    try:
        bootstrap_servers = broker.start()
        click.echo(f"started a local Kafka broker at {bootstrap_servers}", err=True)
        yield bootstrap_servers
    finally:
        broker.stop()
