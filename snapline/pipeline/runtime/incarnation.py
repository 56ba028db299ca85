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
time; checksummed) into checkpoint storage at start, before its first ``init_transactions``.
A worker that is fenced reads it back before it replaces the fenced client: another token
means a later process with this id started (after this one, since it overwrote the mark), and
this one stops with ``SupersededError`` (exit 78) instead. Its own token, or a mark it cannot
read, and it goes on as before: the check can stop a zombie, never a worker that is the newest
of its id. Two services deliberately given one worker id get the same message, which names
the fix.

Threads: ``register`` on the main thread at start; ``check_current`` on the task thread
(before a producer or consumer is replaced).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from snapline.pipeline.checkpoint.metadata import decode_checked, encode_checked
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import ConfigurationError

log = logging.getLogger(__name__)


class SupersededError(ConfigurationError):
    """A later process with this worker id took over: this one stops (exit 78)."""


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


def register(storage: CheckpointStorage, job: str, worker_id: str) -> Incarnation:
    """Write this process's mark (replacing an earlier incarnation's); returns it."""
    me = Incarnation(uuid.uuid4().hex, socket.gethostname(), os.getpid(), time.time())
    body = {"token": me.token, "host": me.host, "pid": me.pid, "started": me.started}
    storage.write_bytes(mark_path(job, worker_id), encode_checked(body))
    return me


def read(storage: CheckpointStorage, job: str, worker_id: str) -> Incarnation:
    """The newest incarnation's mark (raises if it cannot be read or is corrupt)."""
    path = mark_path(job, worker_id)
    body: Any = decode_checked(storage.read_bytes(path), path)
    return Incarnation(str(body["token"]), str(body["host"]), int(body["pid"]), body["started"])


def check_current(
    storage: CheckpointStorage, job: str, worker_id: str, me: Incarnation, fenced: str
) -> None:
    """Raise SupersededError if a later process with ``worker_id`` left its mark since ``me``
    did. ``fenced`` says what was fenced (for the message). A mark that cannot be read proves
    nothing: logged, and the worker goes on."""
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
    raise SupersededError(
        f"worker {worker_id!r} of job {job!r}: its {fenced} was fenced by another process with "
        f"this worker id, which started later ({newest.describe()}); this process "
        f"({me.describe()}) was replaced and stops, rather than fence its successor in turn. "
        "If both are meant to run, give each its own --worker-id (SNAPLINE_WORKER_ID)"
    )
