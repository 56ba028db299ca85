"""Whether a source partition's committed records are all read: asked before its clock calls
the partition idle (DESIGN §7).

A source channel with nothing to process for ``idle_timeout`` seconds is idle only if Kafka
holds nothing more for it either. Nothing arriving locally does not say that: the consumer
may be paused (a savepoint being written), restoring, held back by unsent output, or cut off
from the broker, while a backlog waits. An idle partition stops holding the task's watermark
back (and with every input idle the watermark moves to the largest of theirs), so calling a
partition with a backlog idle makes that backlog late: windows fire without it and its records
go to the dead letters.

So the clock asks: the partition's end for a read_committed reader (the last stable offset,
``ListOffsets`` on the worker's admin client, answered in the background) against the
consumer's position, which moves past transaction markers. The partition is at its end only if
the position has reached the end (an empty partition, end 0, always has); no answer yet, a
failed request, or a position nobody knows all mean "not known to be at its end". The
position is the consumer's, or, before the consumer has fetched anything of the partition,
the offset its task starts from.

Threads: the task thread asks; the admin client answers on its own thread, read through the
request's future.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

log = logging.getLogger(__name__)

TopicPartitionKey = tuple[str, int]

#: Seconds an end-offset request may take before it is given up (and asked again later).
REQUEST_TIMEOUT = 10.0


class SourceEnds:
    """``ends(tp)``: True if the consumer has read every committed record of ``tp``; False if
    records wait or it cannot tell; None while the answer is on its way (ask again later)."""

    def __init__(
        self,
        admin: Callable[[], AdminClient],
        position: Callable[[TopicPartitionKey], int],
        timeout: float = REQUEST_TIMEOUT,
    ) -> None:
        self._admin = admin
        self._position = position
        self._timeout = timeout
        #: tp -> (the question's answer, when asked, the ``since`` it was asked for)
        self._pending: dict[TopicPartitionKey, tuple[Future[Any], float, float]] = {}

    def __call__(self, tp: TopicPartitionKey, since: float = 0.0) -> bool | None:
        """``since``: when the partition last had a record, as its clock says. An answer to a
        question asked in an earlier quiet spell (another ``since``) says nothing about now:
        it is dropped and the question asked again."""
        now = time.monotonic()
        pending = self._pending.get(tp)
        if pending is not None and pending[2] != since:
            del self._pending[tp]
            pending = None
        if pending is None:
            try:
                futures = self._admin().list_offsets(
                    {TopicPartition(tp[0], tp[1]): OffsetSpec.latest()},
                    isolation_level=IsolationLevel.READ_COMMITTED,
                    request_timeout=self._timeout,
                )
            except (KafkaException, ValueError) as exc:
                log.debug("end offset of %s not asked: %s", tp, exc)
                return False
            self._pending[tp] = (next(iter(futures.values())), now, since)
            return None
        future, asked, _ = pending
        if not future.done():
            if now - asked <= self._timeout + 5.0:
                return None
            del self._pending[tp]
            return False
        del self._pending[tp]
        try:
            end = future.result().offset
        except (KafkaException, CancelledError) as exc:
            log.debug("end offset of %s unknown: %s", tp, exc)
            return False
        # Read after the end: records that arrive in between are past both, not waiting.
        position = self._position(tp)
        return end == 0 or (end > 0 and position >= end)

    def forget(self) -> None:
        """The assignment changed: answers asked for the old one are not used."""
        self._pending.clear()
