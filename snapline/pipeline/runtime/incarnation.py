"""Which process is worker ``<id>`` of a job now: the newest incarnation's mark in checkpoint
storage, so that a superseded incarnation stops instead of fighting its successor.

A worker's Kafka identity is its worker id: the static member id ``<job>-<id>`` and the
transactional id ``snapline-<job>-<id>``. When a worker is frozen (a paused VM, a stopped
container, a host cut off) and its orchestrator starts a replacement with the same id on
another host (the local directory's lock, ``local_lock.py``, only covers one host), the
replacement's ``init_transactions`` fences the frozen one's producer and its join fences the
frozen one's consumer. Kafka keeps the output exactly-once either way. But a worker whose
producer or consumer was fenced replaces it in place (an outage can fence a healthy worker's
own earlier membership, librdkafka #3437, and a peer's abort of a departed worker can fence one
that was gone only for a moment), so the woken zombie fenced its successor in turn, and the
two aborted each other's epochs until one gave up.

So each worker writes ``<job>/workers/<worker id>.json`` (a random token, host, pid, start
time; checksummed) into checkpoint storage just before its first ``init_transactions``.
A worker that is fenced reads it back before it replaces the fenced client: another token
means a later process with this id registered since, and once that one proves to run (below)
this one stops with ``SupersededError`` (exit 79, ``EX_SUPERSEDED``: a supervisor restarts
neither it nor stops the others) instead. Its own token, or a mark it cannot read, and it
goes on as before.

A zombie frozen for longer than the liveness timeout does not get that far: on waking, its
watchdog ends it (exit 1 or 75), and its supervisor or orchestrator starts it again on the
same host, where the new process would take the id back from the successor. So each worker
also keeps the token it registered in its local directory (one per host and worker id,
``local_lock.py``). A new process whose local directory names a token other than the mark's
knows another host took the id since this host's last incarnation: it registers only once
that holder is gone from the consumer group (its static member ``<job>-<id>``), waiting for up
to a session timeout and a margin (the holder may have just died), and stops with
``SupersededError`` while it is still a member. A new host (no local token), the usual
restart (the local token is the mark's) and a mark or group that cannot be read register at
once, as before.

A mark is not proof by itself: a process of this id may have registered and died before it
joined the group (killed at start, or its host lost), and the live worker would then stop at
its next fence or client replacement with nobody left to run the id. So a worker that finds
another token waits, up to a session timeout and a margin, for proof that the mark's holder
runs: the group's static member ``<job>-<id>`` held by a member id other than this process's
consumer's (the successor joined, replacing this one's membership). With that it stops (exit
79); when the wait ends and the group says nobody else holds the membership, the holder is
taken for dead: this process writes its own mark back and goes on (a holder that joins later
still is fenced at its next call and stops in turn, so one of them runs, never both); when
Kafka could not say at any time during the wait, the mark decides, and it stops.

What the check cannot tell apart: storage that may return an older version of an overwritten
file could show an earlier incarnation's token (the wait above then ends with this process
writing its mark back). Two services deliberately given one worker id get the same message,
which names the fix.

Threads: ``register`` on the task thread at start; ``check_current`` on the task thread
(before a producer or consumer is replaced).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapline.pipeline.checkpoint.metadata import decode_checked, encode_checked
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.durable import fsync_path
from snapline.pipeline.errors import ConfigurationError

log = logging.getLogger(__name__)


class SupersededError(ConfigurationError):
    """A later process with this worker id took over: this one stops (exit 79,
    ``EX_SUPERSEDED``; a ConfigurationError everywhere else: no restart can help)."""


def exit_code_of(exc: ConfigurationError) -> int:
    """EX_SUPERSEDED for a worker a later process with its id replaced, else EX_CONFIG."""
    from snapline.pipeline.supervisor import EX_CONFIG, EX_SUPERSEDED

    return EX_SUPERSEDED if isinstance(exc, SupersededError) else EX_CONFIG


class StopRequested(Exception):
    """The worker was told to stop while ``register`` waited."""


@dataclass(frozen=True)
class Incarnation:
    """One process of a worker id: a random token, and where and when it started."""

    token: str
    host: str
    pid: int
    started: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"pid {self.pid} on host {self.host}, started {when}"


def mark_path(job: str, worker_id: str) -> str:
    """Where the newest incarnation of ``worker_id`` leaves its mark in checkpoint storage."""
    return f"{job}/workers/{worker_id}.json"


def register(
    storage: CheckpointStorage,
    job: str,
    worker_id: str,
    local_token: Path,
    holder_is_member: Callable[[], bool | None],
    wait: float,
    stopping: Callable[[], bool] = lambda: False,
) -> Incarnation:
    """Write this process's mark, replacing an earlier incarnation's, and keep its token in
    ``local_token`` (a file in the worker's local directory); returns the mark.

    SupersededError when another host took the id since this local directory's last
    incarnation and its holder is still a member of the group after ``wait`` seconds
    (``holder_is_member``: True, False, or None when Kafka cannot say). StopRequested when
    ``stopping`` says so during that wait: nothing is written then."""
    mine = _read_local(local_token)
    try:
        newest: Incarnation | None = read(storage, job, worker_id)
    except Exception as exc:  # none yet, or unreadable: nothing proves a successor
        log.debug("no readable mark of worker %s: %s", worker_id, exc)
        newest = None
    if newest is not None and mine is not None and newest.token != mine:
        deadline = time.monotonic() + wait
        while holder_is_member():
            if time.monotonic() > deadline:
                raise SupersededError(
                    f"worker {worker_id!r} of job {job!r}: another process with this worker "
                    f"id ({newest.describe()}) took it over since this host's last process "
                    f"of it, and is a member of consumer group {job!r} now; this process "
                    "stops rather than take the id back from it (a process frozen or cut "
                    "off for a while, then restarted, was replaced meanwhile). If that "
                    "process is gone for good, start this one again once the group's "
                    "session timeout has passed; if both are meant to run, give each its "
                    "own --worker-id (SNAPLINE_WORKER_ID)"
                )
            for _ in range(10):
                if stopping():
                    raise StopRequested
                time.sleep(0.1)
        log.warning(
            "worker %s: another process (%s) had this worker id since this host's last "
            "process of it, and is gone from the group (or Kafka could not say): taking it "
            "back",
            worker_id,
            newest.describe(),
        )
    me = Incarnation(uuid.uuid4().hex, socket.gethostname(), os.getpid(), time.time())
    _write_mark(storage, job, worker_id, me)
    try:
        _write_local(local_token, me.token)
    except OSError as exc:  # only the check at a later restart is weaker for it
        log.warning("could not keep this incarnation's token in %s: %s", local_token, exc)
    return me


def _write_mark(storage: CheckpointStorage, job: str, worker_id: str, me: Incarnation) -> None:
    body = {"token": me.token, "host": me.host, "pid": me.pid, "started": me.started}
    storage.write_bytes(mark_path(job, worker_id), encode_checked(body))


def _write_local(path: Path, token: str) -> None:
    """Replace ``path``'s content with ``token``, durably (written beside it, fsynced, moved
    into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    written.write_text(token)
    fsync_path(written)
    os.replace(written, path)
    fsync_path(path.parent, directory=True)


def _read_local(path: Path) -> str | None:
    """The token this local directory's last incarnation registered (None: none, or not
    readable)."""
    try:
        token = path.read_text().strip()
    except OSError:
        return None
    return token or None


def read(storage: CheckpointStorage, job: str, worker_id: str) -> Incarnation:
    """The newest incarnation's mark (raises if it cannot be read or is corrupt)."""
    path = mark_path(job, worker_id)
    body: Any = decode_checked(storage.read_bytes(path), path)
    return Incarnation(str(body["token"]), str(body["host"]), int(body["pid"]), body["started"])


def check_current(
    storage: CheckpointStorage,
    job: str,
    worker_id: str,
    me: Incarnation,
    fenced: str,
    holder_joined: Callable[[], bool | None] | None = None,
    wait: float = 0.0,
    stopping: Callable[[], bool] = lambda: False,
) -> None:
    """Raise SupersededError if a later process with ``worker_id`` left its mark since ``me``
    did and runs. ``fenced`` says what was fenced (for the message). A mark that cannot be
    read proves nothing: logged, and the worker goes on.

    ``holder_joined`` says whether another process holds the worker's membership of the group
    now (True, False, or None when Kafka cannot say); it is asked until it says True or
    ``wait`` seconds passed. None for it: the mark alone decides. When the wait ends with the
    group saying False, the holder is taken for dead and ``me`` is written back as the
    newest mark. StopRequested when ``stopping`` says so during the wait."""
    try:
        newest = read(storage, job, worker_id)
    except Exception as exc:
        log.warning(
            "could not read the mark of worker %s's newest incarnation (%s): going on",
            worker_id,
            exc,
        )
        return
    if newest.token == me.token:
        return
    if holder_joined is not None and not _holder_runs(
        holder_joined, wait, stopping, worker_id, newest
    ):
        log.warning(
            "worker %s: another process (%s) left its mark as this worker id's newest, but "
            "did not join the group within %.0fs: it is taken for dead, and this process "
            "(%s) takes the id back",
            worker_id,
            newest.describe(),
            wait,
            me.describe(),
        )
        _write_mark(storage, job, worker_id, me)
        return
    raise SupersededError(
        f"worker {worker_id!r} of job {job!r}: its {fenced} was fenced by another process with "
        f"this worker id, which started later ({newest.describe()}); this process "
        f"({me.describe()}) was replaced and stops, rather than fence its successor in turn. "
        "If both are meant to run, give each its own --worker-id (SNAPLINE_WORKER_ID)"
    )


def _holder_runs(
    holder_joined: Callable[[], bool | None],
    wait: float,
    stopping: Callable[[], bool],
    worker_id: str,
    newest: Incarnation,
) -> bool:
    """Whether the mark's holder proves to run within ``wait`` seconds (it holds the
    membership), or Kafka could never say (the mark then decides); False when the group
    said, at least at the end, that nobody else holds it."""
    deadline = time.monotonic() + wait
    known = False
    logged = False
    while True:
        answer = holder_joined()
        if answer:
            return True
        known = known or answer is not None
        if time.monotonic() >= deadline:
            return not known
        if not logged:
            logged = True
            log.warning(
                "worker %s: another process (%s) left its mark as this worker id's newest; "
                "waiting up to %.0fs for it to join the group before this one stops",
                worker_id,
                newest.describe(),
                wait,
            )
        for _ in range(10):
            if stopping():
                raise StopRequested
            time.sleep(0.1)
