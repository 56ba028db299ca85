"""Whether the worker's consumer still works: it holds an assignment (it is in its group) and
it fetches what its partitions hold. A consumer that fails either for a limit, while a fresh
client finds the broker answering, is stuck and is replaced by the worker like a fenced one.

Both were seen in broker bounce tests (docs/exactly-once.md, "Broker outages"): after a
double outage librdkafka reported its assignment lost and never asked to join again; and a
survivor once kept its tasks but neither read nor committed.

Threads: the task thread only; the probes it is given run there too (bounded calls).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from snapline.pipeline.runtime.kafka_calls import KafkaClientError

#: Seconds without an assignment, or without a fetch while records wait, before the probes
#: run (at least 3 session timeouts for the first).
LIMIT = 60.0


class ConsumerStuckError(KafkaClientError):
    """The consumer is outside its group, or fetches nothing while records wait, and the
    broker answers a fresh client: the worker replaces the consumer."""


class ConsumerWatch:
    """Timers of the two symptoms; :meth:`check` runs the probes once a timer passed the
    limit. Every probe restarts its timer, so they run at most once per limit."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        now = time.monotonic()
        #: Since when the consumer has had no assignment (None: it has one, maybe empty).
        self.unassigned_since: float | None = now
        self.last_fetch = now

    def assigned(self) -> None:
        self.unassigned_since = None
        self.last_fetch = time.monotonic()

    def unassigned(self) -> None:
        self.unassigned_since = time.monotonic()

    def fetched(self, now: float) -> None:
        self.last_fetch = now

    def check(
        self,
        now: float,
        fetching: bool,
        broker_answers: Callable[[], bool],
        records_waiting: Callable[[], int],
    ) -> None:
        """Raise :class:`ConsumerStuckError` if a symptom lasted the limit and the probes
        confirm it. ``fetching``: the worker has tasks and reads (not paused, no backlog of
        held output); only then does a fetch gap count."""
        since = self.unassigned_since
        if since is not None:
            if now - since > self.limit:
                self.unassigned_since = now
                if broker_answers():
                    raise ConsumerStuckError(
                        f"consumer: no partition assignment for {now - since:.0f}s while the "
                        "broker answers (it did not rejoin the group after its session ended)"
                    )
            return
        if not fetching:
            self.last_fetch = now
            return
        if now - self.last_fetch > self.limit:
            silent = now - self.last_fetch
            self.last_fetch = now
            waiting = records_waiting()
            if waiting > 0:
                raise ConsumerStuckError(
                    f"consumer: fetched nothing for {silent:.0f}s while {waiting} committed "
                    "records wait in its assigned partitions"
                )
