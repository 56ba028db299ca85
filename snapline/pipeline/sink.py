"""The two-phase-commit sink contract: write, pre_commit(n), commit(n), abort(n), recover(c).

A ``Sink`` is declared in the pipeline; every task opens its own ``SinkWriter``. The Kafka
transaction of checkpoint n is the commit point (DESIGN §3); ``commit(n)`` runs after it and
must be idempotent and re-runnable, because recovery re-runs it for the committed checkpoint.

Threads: the task thread calls every method. A slow ``pre_commit`` hands its work to a thread
and returns a ``Future``; the checkpoint completes only when that future is done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from snapline.pipeline.record import Record

if TYPE_CHECKING:
    from snapline.pipeline.runtime.transaction import TransactionalOutput

#: What pre_commit may return: nothing, metadata to store in the checkpoint, or a future of it.
PreCommitResult = dict[str, Any] | Future[dict[str, Any]] | None


@dataclass(frozen=True)
class SinkContext:
    """What a sink writer gets from the runtime when a task opens it."""

    job: str
    task_id: str
    worker_id: str
    sink_name: str
    output: TransactionalOutput
    #: Send a record this sink cannot take to the dead-letter topic: (record, reason, epoch).
    dead_letter: Callable[[Record, str, int], None]
    #: The Kafka cluster the job runs on ("" if unknown); sinks that keep a commit log record
    #: it and refuse to mix the histories of two clusters (see checkpoint/identity.py).
    cluster_id: str = ""
    #: The worker's fault points of the tests (``runtime/faults.py``): a sink that has one
    #: passes it by name; a no-op unless ``SNAPLINE_FAULT`` names it.
    fault_point: Callable[[str], None] = field(default=lambda name: None)


class SinkWriter(ABC):
    """One task's writer for one sink."""

    def write_batch(self, records: Sequence[Record], epoch: int) -> None:
        """Buffer or send ``records``, which belong to checkpoint ``epoch``."""
        for record in records:
            self.write(record, epoch)

    @abstractmethod
    def write(self, record: Record, epoch: int) -> None: ...

    def pre_commit(self, checkpoint_id: int) -> PreCommitResult:
        """Barrier n passed: make everything of epochs ≤ n durable but invisible."""
        return None

    def commit(self, checkpoint_id: int) -> None:  # noqa: B027 - default no-op
        """Checkpoint n is committed: publish its data. Idempotent."""

    def abort(self, checkpoint_id: int) -> None:  # noqa: B027 - default no-op
        """Checkpoint n (and all later epochs) will never commit: discard their data."""

    def recover(self, committed: int | None, metadata: dict[str, Any] | None) -> None:  # noqa: B027
        """Task (re)started from committed checkpoint ``committed`` (None: no checkpoint).

        Re-run ``commit`` for data of checkpoints ≤ committed that may not be published yet,
        and discard data of later checkpoints. ``metadata`` is what this writer's
        ``pre_commit`` returned for that checkpoint.
        """

    def checkpoint_ids_above(self) -> int | None:
        """After ``recover``: a checkpoint id the sink's output already holds for this task,
        which the job's next ids must exceed (None: no such bound). The PostgreSQL sink's
        upsert keeps rows a task wrote at higher ids; a job whose checkpoint storage was wiped
        or replaced would number its checkpoints from 1 again."""
        return None

    def close(self) -> None:  # noqa: B027 - default no-op
        """The task is going away (moved to another worker, or the worker stops)."""


class Sink(ABC):
    """A declared output of a pipeline."""

    #: Unique name within the pipeline (used in checkpoint metadata and metrics).
    name: str = "sink"

    def validate(self) -> None:  # noqa: B027 - default no-op
        """Fail at start with a ConfigurationError that names the fix."""

    def output_topics(self) -> dict[str, int | None]:
        """Kafka topics this sink writes (name -> partitions to create it with when missing;
        None: the rule's default). The runtime creates missing ones at start."""
        return {}

    @abstractmethod
    def open(self, context: SinkContext) -> SinkWriter: ...
