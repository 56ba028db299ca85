"""Abort the open transaction of a worker that left the group for good.

A worker that dies holding an open Kafka transaction blocks every ``read_committed`` reader
of the partitions it wrote to (the last stable offset stops there) until the broker aborts
the transaction, ``transaction.timeout.ms`` (60 s) after it began, even though its tasks
moved to the survivors within the session timeout. A restarted worker aborts its own
predecessor's transaction at once (``init_transactions`` with the same transactional id);
one that never comes back has nobody to do that.

So the worker that takes over a task whose last committed checkpoint was written by another
worker does it for that worker, but only if the consumer group says it is gone: its static
member id (``<job>-<worker id>``) is not a member of the group the rebalance just formed.
A worker missing from the group is dead, or a zombie whose commit the group coordinator
refuses anyway; ``init_transactions`` with its transactional id aborts its open transaction
and fences its producer, as its own restart would. A worker that restarts in the instant
between the membership check and that call is fenced once, exits with code 75 and starts
again; nothing committed is touched either way.

Off unless ``SNAPLINE_ABORT_DEPARTED=1``: in the CI run that first included it, a savepoint
test under heavy machine load (another 3-broker test running beside it) found orders output
twice after a restart from a savepoint. It passed alone and the cause is not known yet, so
the abort stays opt-in until its interplay with rebalances under load is understood.

Threads: ``start`` runs the work in a daemon thread (the task thread goes on processing).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

log = logging.getLogger(__name__)

#: Bound of each Kafka call made here (seconds).
CALL_TIMEOUT = 30.0


def enabled() -> bool:
    """``SNAPLINE_ABORT_DEPARTED=1`` turns the abort of departed workers' transactions on."""
    return os.environ.get("SNAPLINE_ABORT_DEPARTED", "") == "1"


def transactional_id(job: str, worker_id: str) -> str:
    """The transactional id of a worker's producer."""
    return f"snapline-{job}-{worker_id}"


def instance_id(job: str, worker_id: str) -> str:
    """The static group member id of a worker's consumer."""
    return f"{job}-{worker_id}"


def group_instances(kafka_config: dict[str, Any], group: str) -> set[str]:
    """The static member ids of the group's current members (raises on failure)."""
    admin = AdminClient(kafka_config)
    future = admin.describe_consumer_groups([group], request_timeout=CALL_TIMEOUT)[group]
    description = future.result(timeout=CALL_TIMEOUT)
    return {m.group_instance_id for m in description.members if m.group_instance_id}


def fence_departed(
    kafka_config: dict[str, Any],
    job: str,
    worker_id: str,
    previous_owners: set[str],
    event: Callable[[dict[str, Any]], None],
) -> list[str]:
    """Abort the open transactions of the ``previous_owners`` that are not members of the
    job's group; returns the worker ids fenced."""
    owners = sorted(w for w in previous_owners if w != worker_id)
    if not owners:
        return []
    try:
        members = group_instances(kafka_config, job)
    except Exception as exc:  # without the membership nobody is provably gone
        log.warning("could not read the members of group %s (%s): fencing nobody", job, exc)
        return []
    fenced = []
    for owner in owners:
        if instance_id(job, owner) in members:
            continue
        started = time.monotonic()
        config = {
            **kafka_config,
            "transactional.id": transactional_id(job, owner),
            "client.id": f"{job}-{worker_id}-fencing-{owner}",
        }
        try:
            producer = Producer(config)
            producer.init_transactions(CALL_TIMEOUT)
        except Exception as exc:  # e.g. the owner came back and fenced this producer first
            log.warning("could not abort the transaction of departed worker %s: %s", owner, exc)
            continue
        finally:
            producer = None  # closed by garbage collection; nothing of it is pending
        seconds = round(time.monotonic() - started, 3)
        log.warning(
            "worker %s left the group and its tasks came here: aborted its open transaction "
            "(read_committed readers of its output partitions go on now, not after "
            "transaction.timeout.ms) in %.2fs",
            owner,
            seconds,
        )
        event({"event": "fenced_departed", "departed": owner, "seconds": seconds})
        fenced.append(owner)
    return fenced


def start(
    kafka_config: dict[str, Any],
    job: str,
    worker_id: str,
    previous_owners: set[str],
    event: Callable[[dict[str, Any]], None],
) -> threading.Thread | None:
    """``fence_departed`` in a daemon thread (None when there is nobody to check)."""
    if not {w for w in previous_owners if w != worker_id}:
        return None
    thread = threading.Thread(
        target=fence_departed,
        args=(kafka_config, job, worker_id, set(previous_owners), event),
        name="fence-departed",
        daemon=True,
    )
    thread.start()
    return thread
