"""The task thread's liveness: a watchdog ends a worker whose task thread stopped making
progress, after writing every thread's stack to stderr, so that its supervisor restarts it
and recovery restores the committed checkpoint (Flink's task cancellation watchdog).

Threads: the task thread calls :meth:`Liveness.beat` (each turn of its loop) and
:meth:`Liveness.allow` (before a wait that is bounded elsewhere); the watchdog thread only
reads the deadline. A stall that holds the GIL also stops the watchdog thread, so the
watchdog keeps a ``faulthandler`` timer armed (a C thread that needs no GIL): it dumps the
stacks and exits with code 1 shortly after the deadline (:func:`backstop_after`).
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from collections.abc import Callable

from snapline.pipeline.runtime.kafka_calls import EX_TEMPFAIL

#: Default seconds the task thread may go without progress: Flink's task cancellation
#: timeout, and below librdkafka's max.poll.interval.ms (300 s), after which a stuck
#: consumer leaves the group while its process lives on.
DEFAULT_TIMEOUT = 180.0
#: Smallest timeout accepted (0 turns the watchdog off): beats come every few milliseconds,
#: but a restore or a savepoint writes one task's files between two of them.
MIN_TIMEOUT = 5.0
#: How often the watchdog looks, and re-arms the faulthandler timer at most.
CHECK_INTERVAL = 1.0
REARM_INTERVAL = 5.0


def backstop_after(timeout: float) -> float:
    """Seconds after the deadline at which the faulthandler timer ends a process whose
    watchdog thread could not run (the GIL held by the stalled thread): the timeout, within
    10..30 s. It must exceed REARM_INTERVAL + CHECK_INTERVAL, or the timer could fire
    between two re-arms of a thread that is making progress."""
    return min(30.0, max(10.0, timeout))


class Liveness:
    """When the task thread must next show progress (a float: one store per beat)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout

    def beat(self) -> None:
        """The task thread made progress (a turn of its loop, a task restored)."""
        self.deadline = time.monotonic() + self.timeout

    def allow(self, seconds: float) -> None:
        """The task thread enters a wait that something else bounds by ``seconds`` (a
        bounded client call, a broker outage's limit): it is not stalled meanwhile."""
        self.deadline = max(self.deadline, time.monotonic() + seconds + self.timeout)


def check_timeout(timeout: float) -> str | None:
    """What is wrong with a liveness timeout (None: nothing)."""
    if timeout == 0 or MIN_TIMEOUT <= timeout <= 86_400:
        return None
    return (
        f"liveness timeout {timeout!r} must be 0 (off) or {MIN_TIMEOUT:.0f}..86400 seconds "
        f"(default {DEFAULT_TIMEOUT:.0f})"
    )


def end_stalled_process(silent_for: float, timeout: float) -> None:
    """Write why and every thread's stack to stderr, then exit with EX_TEMPFAIL at once.

    Nothing here takes a lock that the stalled thread may hold (logging's, a client's): the
    message goes straight to file descriptor 2."""
    message = (
        f"\nsnapline: the task thread made no progress for {silent_for:.0f}s (liveness "
        f"timeout {timeout:.0f}s); every thread's stack follows. Exiting {EX_TEMPFAIL}: a "
        "restarted worker recovers from the committed checkpoint.\n"
    )
    os.write(2, message.encode())
    faulthandler.dump_traceback(file=2, all_threads=True)
    os._exit(EX_TEMPFAIL)


class Watchdog:
    """Watches a :class:`Liveness` on a daemon thread; calls ``on_stall(silent_for)`` once
    the deadline has passed (default: :func:`end_stalled_process`)."""

    def __init__(
        self,
        liveness: Liveness,
        on_stall: Callable[[float, float], None] = end_stalled_process,
        *,
        backstop: bool = True,
    ) -> None:
        self.liveness = liveness
        self._on_stall = on_stall
        self._backstop = backstop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CHECK_INTERVAL * 5)
        if self._backstop:
            faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        armed_at = float("-inf")
        while not self._stop.wait(CHECK_INTERVAL):
            now = time.monotonic()
            left = self.liveness.deadline - now
            if left < 0:
                self._on_stall(self.liveness.timeout - left, self.liveness.timeout)
                return
            if self._backstop and now - armed_at >= REARM_INTERVAL:
                faulthandler.dump_traceback_later(
                    left + backstop_after(self.liveness.timeout), exit=True, file=2
                )
                armed_at = now
