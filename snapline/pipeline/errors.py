"""The one exception hierarchy of Snapline: every error a user sees derives from SnaplineError."""

from __future__ import annotations

from collections.abc import Callable, Iterator


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it was raised from (``__cause__``, else ``__context__``), and so
    on, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def first_in_chain(
    exc: BaseException, match: Callable[[BaseException], bool]
) -> BaseException | None:
    """The first error of ``error_chain(exc)`` that ``match`` accepts, or None."""
    return next((e for e in error_chain(exc) if match(e)), None)


class SnaplineError(Exception):
    """Base of all Snapline errors."""


class ConfigurationError(SnaplineError):
    """A pipeline, CLI flag or connector setting cannot work; the message names the fix."""


class CheckpointError(SnaplineError):
    """A checkpoint could not be written, read, verified or committed."""


class CheckpointStorageError(CheckpointError):
    """Checkpoint storage refused a write (full, unreachable, no permission): the checkpoint
    fails, but the epoch's data is intact and can go into the next checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file failed its checksum or could not be decoded."""


class StateError(SnaplineError):
    """Keyed state was used wrongly (outside a keyed function, bad serde, ...)."""


class SinkError(SnaplineError):
    """A sink could not write, pre-commit, commit or recover."""


class SinkUnavailableError(SinkError):
    """A sink's system could not be reached (a database down, a connection lost). A worker
    that ends on it exits with EX_TEMPFAIL (75): restarted, it recovers from the committed
    checkpoint and publishes what that checkpoint staged, so an outage is waited out by
    restarts with backoff instead of counting as crashes that stop the job."""


class BrokerError(SnaplineError):
    """The local Kafka broker could not be provisioned or started."""
