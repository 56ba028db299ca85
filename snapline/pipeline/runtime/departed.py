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

The same abort runs before a restore when the committed offsets cannot be read: a worker
that died between sending its offsets to its transaction and committing it leaves them pending,
unreadable until its transaction times out. The writers of the tasks' newest checkpoints (the
dead worker wrote one just before) that are not members are fenced then
(``Worker._fence_pending_writers``).

Checkpoints that ``snapline run --from-savepoint`` seeded name the writer ``SEEDED`` (no
worker, no transaction): nothing to abort for them.

Threads: ``start`` runs the work in a daemon thread (the task thread goes on processing).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.runtime.kafka_calls import listed_groups

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


#: A worker id: what Kafka accepts in the static member id ``<job>-<worker id>``
#: (``group.instance.id``), and a directory name (the worker's local state).
_WORKER_ID = re.compile(r"[A-Za-z0-9._-]{1,100}")
#: A pipeline name (``Pipeline``'s own rule), for the other readings of a member id.
_JOB = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,100}")


def check_worker_id(worker_id: str) -> None:
    """Refuse a worker id Kafka or the local directory cannot take (ConfigurationError)."""
    if (
        not isinstance(worker_id, str)
        or worker_id in (".", "..")
        or not _WORKER_ID.fullmatch(worker_id)
    ):
        raise ConfigurationError(
            f"worker id {worker_id!r} must be 1-100 characters of letters, digits, '.', '_' or "
            "'-', and not '.' or '..' (it is part of the worker's Kafka member id and "
            "transactional id and names its local state directory): pass --worker-id, or set "
            "SNAPLINE_WORKER_ID (the default is the host name)"
        )


def namesakes(job: str, worker_id: str) -> list[tuple[str, str]]:
    """The other (job, worker id) pairs with this worker's member id and transactional id:
    ``<job>-<worker id>`` read at another '-' (job ``a`` with worker ``b-c``, job ``a-b``
    with worker ``c``)."""
    joined = instance_id(job, worker_id)
    pairs = []
    for i, char in enumerate(joined):
        if char == "-" and i != len(job):
            other_job, other_worker = joined[:i], joined[i + 1 :]
            if _JOB.fullmatch(other_job) and _WORKER_ID.fullmatch(other_worker):
                pairs.append((other_job, other_worker))
    return pairs


def running_namesake(
    kafka_config: dict[str, Any], job: str, worker_id: str, timeout: float = CALL_TIMEOUT
) -> tuple[str, str] | None:
    """The (job, worker id) of another pipeline's worker with this worker's transactional id
    that is a member of its job's group now, or None (raises if Kafka cannot say)."""
    pairs = namesakes(job, worker_id)
    if not pairs:
        return None
    admin = AdminClient(kafka_config)
    # Only groups with members are described: a describe looks up each group's coordinator,
    # which can abort the process when it times out while the cluster comes up
    # (listed_groups), and the candidates are rarely groups at all.
    groups = listed_groups(admin, timeout, [other for other, _ in pairs])
    pairs = [(other, other_worker) for other, other_worker in pairs if groups.get(other)]
    if not pairs:
        return None
    futures = admin.describe_consumer_groups([other for other, _ in pairs], request_timeout=timeout)
    me = instance_id(job, worker_id)
    for other, other_worker in pairs:
        description = futures[other].result(timeout=timeout)
        if any(m.group_instance_id == me for m in description.members):
            return other, other_worker
    return None


def check_no_namesake(
    kafka_config: dict[str, Any], job: str, worker_id: str, timeout: float = CALL_TIMEOUT
) -> None:
    """Refuse to start (or, once fenced, to go on with) a worker whose transactional id a
    running worker of another job has (ConfigurationError): each one's ``init_transactions``
    would fence the other, for as long as both are restarted."""
    try:
        namesake = running_namesake(kafka_config, job, worker_id, timeout)
    except Exception as exc:  # the check is a courtesy: Kafka's own fencing stays correct
        log.warning("could not check for another job's worker with this transactional id: %s", exc)
        return
    if namesake is not None:
        other, other_worker = namesake
        raise ConfigurationError(
            f"worker {worker_id!r} of job {job!r} would have the Kafka transactional id "
            f"{transactional_id(job, worker_id)!r}, which worker {other_worker!r} of job "
            f"{other!r} (a member of consumer group {other!r} now) has too: the two would "
            "fence each other's transactions in turn. Give this worker another --worker-id "
            "(or the job another name), one that does not read as the other job's name, "
            "'-' and a worker id"
        )


def transactional_id(job: str, worker_id: str) -> str:
    """The transactional id of a worker's producer."""
    return f"snapline-{job}-{worker_id}"


def instance_id(job: str, worker_id: str) -> str:
    """The static group member id of a worker's consumer."""
    return f"{job}-{worker_id}"


def group_instances(
    kafka_config: dict[str, Any], group: str, timeout: float = CALL_TIMEOUT
) -> set[str]:
    """The static member ids of the group's current members (raises on failure)."""
    return set(group_members(kafka_config, group, timeout))


def group_members(
    kafka_config: dict[str, Any], group: str, timeout: float = CALL_TIMEOUT
) -> dict[str, str]:
    """Static member id -> member id of the group's current static members (raises on
    failure). The group
    is described only when ListGroups says it may have members (``listed_groups``: a
    DescribeGroups whose coordinator lookup times out can abort the process later, and the
    callers ask exactly when a coordinator may be slow)."""
    admin = AdminClient(kafka_config)
    listed = listed_groups(admin, timeout, [group])
    if group not in listed:
        # No broker listed it and none failed: its coordinator may be missing from the
        # metadata (no leader for its __consumer_offsets partition). Not "no members".
        raise KafkaException(KafkaError(KafkaError._UNKNOWN_GROUP, f"group {group} not listed"))
    if not listed[group]:
        return {}  # listed as empty or dead: no members
    future = admin.describe_consumer_groups([group], request_timeout=timeout)[group]
    description = future.result(timeout=timeout)
    return {m.group_instance_id: m.member_id for m in description.members if m.group_instance_id}


def is_member(
    kafka_config: dict[str, Any], job: str, worker_id: str, timeout: float = 10.0
) -> bool | None:
    """Whether worker ``worker_id`` (its static member id) is a member of the job's group
    now; None when Kafka cannot say."""
    try:
        return instance_id(job, worker_id) in group_instances(kafka_config, job, timeout)
    except Exception as exc:
        log.warning("could not read the members of group %s: %s", job, exc)
        return None


def held_by_another(
    kafka_config: dict[str, Any],
    job: str,
    worker_id: str,
    own_member_id: str | None,
    timeout: float = 10.0,
) -> bool | None:
    """Whether worker ``worker_id``'s static membership of the job's group is held now by a
    member other than ``own_member_id`` (this process's consumer's member id: None when it has
    none); None when Kafka cannot say."""
    try:
        member = group_members(kafka_config, job, timeout).get(instance_id(job, worker_id))
    except Exception as exc:
        log.warning("could not read the members of group %s: %s", job, exc)
        return None
    return member is not None and member != own_member_id


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
    gone = [owner for owner in owners if instance_id(job, owner) not in members]
    return abort_transactions(
        kafka_config,
        job,
        gone,
        f"{job}-{worker_id}",
        event,
        "left the group and its tasks came here",
    )


def abort_transactions(
    kafka_config: dict[str, Any],
    job: str,
    workers: list[str],
    client: str,
    event: Callable[[dict[str, Any]], None],
    why: str,
    *,
    fence_if_unsure: bool = True,
    parallel: int = 1,
) -> list[str]:
    """Abort the open transaction of each of ``workers`` of ``job`` (``init_transactions``
    with its transactional id, which also fences a zombie holding it), the caller having
    established that none of them is a member of the job's group. A transactional id that
    another job's running worker has too (``running_namesake``) is left alone; when that
    cannot be checked (no rights to describe other groups), the worker is fenced only with
    ``fence_if_unsure``. ``parallel`` workers at a time, each call bounded by CALL_TIMEOUT.
    Returns the worker ids fenced; failures are logged."""
    owners = [w for w in workers if w != SEEDED]

    def one(owner: str) -> bool:
        return _abort_one(kafka_config, job, owner, client, event, why, fence_if_unsure)

    if parallel <= 1 or len(owners) <= 1:
        return [owner for owner in owners if one(owner)]
    with ThreadPoolExecutor(min(parallel, len(owners)), thread_name_prefix="fence") as pool:
        done = list(pool.map(one, owners))
    return [owner for owner, fenced in zip(owners, done, strict=True) if fenced]


def _abort_one(
    kafka_config: dict[str, Any],
    job: str,
    owner: str,
    client: str,
    event: Callable[[dict[str, Any]], None],
    why: str,
    fence_if_unsure: bool,
) -> bool:
    try:
        namesake = running_namesake(kafka_config, job, owner)
    except Exception as exc:  # other groups may not be ours to describe (ACLs)
        log.info("could not check the other readings of %s's transactional id: %s", owner, exc)
        if not fence_if_unsure:
            return False
        namesake = None
    if namesake is not None:  # that transactional id is another job's live worker's
        log.warning(
            "not aborting worker %s's transaction: worker %s of job %s, running, "
            "has the same transactional id",
            owner,
            namesake[1],
            namesake[0],
        )
        return False
    started = time.monotonic()
    config = {
        **kafka_config,
        "transactional.id": transactional_id(job, owner),
        "client.id": f"{client}-fencing-{owner}",
    }
    try:
        producer = Producer(config)
        producer.init_transactions(CALL_TIMEOUT)
    except Exception as exc:  # e.g. the owner came back and fenced this producer first
        log.warning("could not abort the transaction of worker %s: %s", owner, exc)
        return False
    del producer  # nothing of it is pending: its destructor returns at once
    seconds = round(time.monotonic() - started, 3)
    log.warning(
        "worker %s %s: fenced its transactional id, which aborts any transaction it left open "
        "(read_committed readers of its output partitions go on now, not after "
        "transaction.timeout.ms), in %.2fs",
        owner,
        why,
        seconds,
    )
    event({"event": "fenced_departed", "departed": owner, "seconds": seconds})
    return True


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
