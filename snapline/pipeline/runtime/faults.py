"""Fault injection for tests: SIGKILL (or freeze) this worker at a named point of the
checkpoint protocol.

``SNAPLINE_FAULT="after_kafka_commit:0.3,sync_snapshot:0.05"`` kills the process with
probability p each time it passes that point; ``name:p:stop`` sends it SIGSTOP instead (it
carries on from that very point when a SIGCONT comes, and a stop fires at most once per
process, which is how the zombie tests make a
worker wake up in the middle of the commit protocol). Two actions break the worker's consumer
there instead, once per process, as librdkafka did after broker outages (the worker must
notice and replace it): ``name:p:leave`` makes it leave its group, ``name:p:stall`` makes it
stop fetching. ``SNAPLINE_FAULT_LOG`` names a file
where each hit is appended first (so tests can count hits). Without the variable this is a
no-op.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable

KILL_POINTS = (
    "after_namesake_check",  # start: no other job's worker has this transactional id
    "restore_before_kafka_changes",  # a savepoint restore: checks done, Kafka not changed yet
    "restore_before_marker",  # a savepoint restore: checked, its marker not written yet
    "restore_before_topics",  # a savepoint restore: marker written, topics not recreated yet
    "restore_before_delete",  # a savepoint restore: guard asked, a topic's DeleteRecords not sent
    # a savepoint restore: its last guard check asked, its transaction (records in flight,
    # offsets) not committed
    "restore_before_commit",
    "after_offsets_read",  # recovery read the committed offsets, restored nothing yet
    "before_restore_state",  # a task's checkpoint found in storage, its files not read yet
    "before_sink_recovery",  # a task's checkpoint restored and marked, its sinks not recovered
    "after_repartition_produce",  # an epoch's repartition records produced, not committed
    "sync_snapshot",  # right after the synchronous part of a task's snapshot
    "mid_materialization",  # state written to storage, metadata not yet
    "after_metadata_write",  # all metadata durable, Kafka transaction not committed
    "after_offsets_sent",  # source offsets sent to the transaction, not committed yet
    "after_kafka_commit",  # commit point passed, sinks not yet notified
    # a PostgreSQL sink's apply of a checkpoint: rows upserted, its transaction not committed
    "mid_sink_apply",
    "before_repartition_delete",  # a repartition topic's id checked, its DeleteRecords not sent
    "after_repartition_delete",  # the broker answered a DeleteRecords of repartition records
    # a DeleteRecords of repartition records not sent: its topic id check is too old
    "repartition_delete_skipped",
    # a DeleteRecords of repartition records: its id check found fresh, the request not sent
    "repartition_delete_fresh",
)
#: Points passed on a librdkafka thread (a request's callback), not the task thread.
_CALLBACK_POINTS = frozenset(
    {
        "before_repartition_delete",
        "after_repartition_delete",
        "repartition_delete_skipped",
        "repartition_delete_fresh",
    }
)
#: What each action does: a signal to this process, or the name of the worker's hook that
#: breaks its consumer ("leave", "stall").
_ACTIONS: dict[str, signal.Signals | str] = {
    "": signal.SIGKILL,
    "kill": signal.SIGKILL,
    "stop": signal.SIGSTOP,
    "leave": "leave",
    "stall": "stall",
}


class FaultInjector:
    """Parses the fault spec once; ``point(name)`` may kill the process."""

    def __init__(self, spec: str | None = None, log_path: str | None = None) -> None:
        spec = os.environ.get("SNAPLINE_FAULT", "") if spec is None else spec
        self._log_path = os.environ.get("SNAPLINE_FAULT_LOG") if log_path is None else log_path
        self._odds: dict[str, float] = {}
        self._actions: dict[str, signal.Signals | str] = {}
        #: What the consumer-breaking actions do (the worker sets them).
        self.hooks: dict[str, Callable[[], None]] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, _, rest = part.partition(":")
            prob, _, action = rest.partition(":")
            if name not in KILL_POINTS:
                raise ValueError(f"unknown kill point {name!r}; use one of {KILL_POINTS}")
            if action not in _ACTIONS:
                raise ValueError(
                    f"unknown fault action {action!r} for {name}; use kill, stop, leave or stall"
                )
            if name in _CALLBACK_POINTS and isinstance(_ACTIONS[action], str):
                # A librdkafka thread: breaking the consumer there would race the task thread.
                raise ValueError(f"{name} is passed on a librdkafka thread: use kill or stop")
            self._odds[name] = float(prob or 1.0)
            self._actions[name] = _ACTIONS[action]
        self._random = random.Random()

    @property
    def enabled(self) -> bool:
        return bool(self._odds)

    def point(self, name: str) -> None:
        odds = self._odds.get(name)
        if odds is None or self._random.random() >= odds:
            return
        if self._log_path:
            with open(self._log_path, "a") as fh:
                fh.write(f"{time.time():.3f} {os.getpid()} {name}\n")
                fh.flush()
                os.fsync(fh.fileno())
        action = self._actions[name]
        if action != signal.SIGKILL:
            del self._odds[name]
        if isinstance(action, str):
            self.hooks[action]()
        else:
            _signal_this_thread(action)


def _signal_this_thread(sig: signal.Signals) -> None:
    """Send ``sig`` to the calling thread, which then stops (or dies) before it runs another
    line. A stop sent to the process (``os.kill(os.getpid(), SIGSTOP)``) is taken by one
    thread the kernel chooses, often the main thread, and stops the others only once that
    thread has run: the caller went on meanwhile, on a loaded machine for long enough to
    send a request (a zombie test froze "before" a DeleteRecords that it had already sent).
    SIGSTOP and SIGKILL still stop or end every thread of the process."""
    signal.pthread_kill(threading.get_ident(), sig)
