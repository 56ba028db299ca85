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
and fences its producer, as its own restart would. A worker that is back in the group by
the time of that call (it was out only for a moment, or restarted in that instant) is fenced
while it runs: it replaces its producer and restores its tasks in the same process
(transaction.py, ``TransactionalOutput._fenced``). Nothing committed is touched either way.

On by default; ``SNAPLINE_ABORT_DEPARTED=0`` turns it off (then the open transaction of a
worker that never comes back ends after ``transaction.timeout.ms``). It was opt-in for one
round after a CI run found orders output twice after a restart from a savepoint; that was the
test counting the orders in flight at the savepoint twice (integration_tests/test_savepoints.py),
not this abort.

Checkpoints that ``snapline run --from-savepoint`` seeded name the writer ``SEEDED`` (no
worker, no transaction): nothing to abort for them.

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


#: The writer named in checkpoints seeded from a savepoint: not a worker.
SEEDED = "savepoint"


def enabled() -> bool:
    """On unless ``SNAPLINE_ABORT_DEPARTED=0``."""
    return os.environ.get("SNAPLINE_ABORT_DEPARTED", "1") != "0"


def _others(previous_owners: set[str], worker_id: str) -> list[str]:
    """The previous owners that may hold a transaction to abort: not this worker, not a
    savepoint seed."""
    return sorted(w for w in previous_owners if w not in (worker_id, SEEDED))


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
    owners = _others(previous_owners, worker_id)
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
        del producer  # nothing of it is pending: its destructor returns at once
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
    if not _others(previous_owners, worker_id):
        return None
    thread = threading.Thread(
        target=fence_departed,
        args=(kafka_config, job, worker_id, set(previous_owners), event),
        name="fence-departed",
        daemon=True,
    )
    thread.start()
    return thread
