"""The second phase of a committed checkpoint's sinks, run outside a running task.

A Parquet or PostgreSQL sink stages a checkpoint's output before Kafka commits it and
publishes it after; a worker that dies in between leaves it staged, and the task's next
restore from that checkpoint publishes it. When no restore from it will come (the
checkpoint is deleted by ``--reset-state``, or replaced by a savepoint's), the output is
published here first: Kafka holds that checkpoint's records, so the table and the database
must get theirs.
"""

from __future__ import annotations

import logging
from typing import Any

from snapline.pipeline.errors import CheckpointError
from snapline.pipeline.graph import Pipeline
from snapline.pipeline.runtime.transaction import TransactionalOutput
from snapline.pipeline.sink import Sink, SinkContext

log = logging.getLogger(__name__)


def publish_staged(
    pipeline: Pipeline,
    sinks: dict[str, Sink],
    task_id: str,
    worker_id: str,
    checkpoint_id: int,
    staged: dict[str, Any],
    output: TransactionalOutput | None,
    cluster_id: str = "",
) -> None:
    """Publish what committed checkpoint ``checkpoint_id`` of ``task_id`` staged in each of
    ``sinks`` (by name; ``staged``: the checkpoint metadata's ``sinks``), as a restore from
    it does: idempotent, so a live owner's own publish may meet it. Each writer opens with
    ``output`` (a worker's transactional output; None where only sinks that produce nothing
    to Kafka are given). A sink with nothing staged is not opened; one not in ``sinks`` is
    logged, its output not published. Raises if a publish fails."""

    def refuse(record: Any, reason: str, epoch: int) -> None:
        raise CheckpointError(f"a sink's recovery sent a record to the dead letters: {reason}")

    for name, metadata in staged.items():
        sink = sinks.get(name)
        if not metadata or sink is None:
            if metadata:
                log.warning(
                    "checkpoint %d of task %s staged output in sink %s, which the code no "
                    "longer has: it is not published",
                    checkpoint_id,
                    task_id,
                    name,
                )
            continue
        context = SinkContext(
            pipeline.name,
            task_id,
            worker_id,
            name,
            output,  # type: ignore[arg-type]  # None: the sinks given produce nothing to Kafka
            refuse,
            cluster_id,
        )
        writer = sink.open(context)
        try:
            writer.recover(checkpoint_id, metadata)
        finally:
            writer.close()
        log.info(
            "published what checkpoint %d of task %s staged in sink %s",
            checkpoint_id,
            task_id,
            name,
        )
