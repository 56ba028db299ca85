"""Bounded calls into librdkafka and what each Kafka error means for a worker.

Every client call that can block runs through :class:`BoundedCall`: the call runs on a
short-lived daemon thread and the task (main) thread waits for it at most a bound, staying
responsive to signals meanwhile. librdkafka does not always honour its own timeouts
(``send_offsets_to_transaction`` can block forever while the group coordinator is
unreachable, librdkafka #5456/#5511), so a call that outlives its bound marks the client as
unusable: the worker then exits with :data:`EX_TEMPFAIL` and its supervisor restarts it, and
recovery restores the committed checkpoint.

Threads: the task thread calls everything here; each client call runs on its own daemon
thread, one at a time per :class:`BoundedCall`, except the consumer's calls inside its
rebalance callbacks, which run on the callback's thread (``BoundedCall``'s ``inline``).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import confluent_kafka
from confluent_kafka import ConsumerGroupState, KafkaError, KafkaException

from snapline.pipeline.errors import CheckpointError, SnaplineError

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

    from snapline.pipeline.runtime.liveness import Liveness

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Exit code of a worker whose Kafka clients cannot go on ("temporary failure, restart me",
#: sysexits.h EX_TEMPFAIL): the broker was unreachable for too long, a client call hung, or a
#: client hit a fatal error. A restarted worker recovers from the committed checkpoint.
EX_TEMPFAIL = 75

#: Extra time a client call gets beyond the timeout it was given before it counts as hung.
HANG_GRACE = 15.0


def installed_client_version() -> str:
    """The confluent-kafka release in use, e.g. "2.12.2". ``confluent_kafka.version()``
    returns that string in the releases Snapline supports (older ones returned a tuple of it
    and an int): its ``[0]`` is "2"."""
    found: Any = confluent_kafka.version()
    return str(found if isinstance(found, str) else found[0])


def exit_now(code: int) -> None:
    """End the process at once: librdkafka's destructors may block while the broker is gone
    (a consumer's destructor closes it, a hung call's thread never returns)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Errors that say "the broker (or a coordinator on it) is not reachable right now". They are
# retried with backoff inside a call's bound; when the bound runs out the worker waits for the
# broker instead of counting a checkpoint failure.
_UNAVAILABLE = {
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._TIMED_OUT,
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError._MSG_TIMED_OUT,
    KafkaError._WAIT_COORD,
    KafkaError._RESOLVE,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.CONCURRENT_TRANSACTIONS,
    KafkaError.UNSTABLE_OFFSET_COMMIT,
}


class ErrorClass(enum.Enum):
    """What the worker does about a Kafka error (docs/exactly-once.md, "Broker outages")."""

    #: Try the same call again with backoff while its bound lasts.
    RETRIABLE = "retriable"
    #: Abort the epoch and restore every task from the committed checkpoint.
    ABORTABLE = "abortable"
    #: The client cannot be used any more: exit with EX_TEMPFAIL.
    FATAL = "fatal"


def classify(error: KafkaError) -> ErrorClass:
    # librdkafka reports a fatal error as an error event with code _FATAL, on which fatal()
    # can be False; the underlying error (e.g. a fenced static member) is in the message.
    if error.fatal() or error.code() in (KafkaError._FATAL, KafkaError._FENCED):
        return ErrorClass.FATAL
    if error.code() in (KafkaError.PRODUCER_FENCED, KafkaError.FENCED_INSTANCE_ID):
        return ErrorClass.FATAL
    if error.txn_requires_abort():
        return ErrorClass.ABORTABLE
    if error.retriable() or error.code() in _UNAVAILABLE:
        return ErrorClass.RETRIABLE
    return ErrorClass.ABORTABLE


def kafka_error(exc: BaseException) -> KafkaError | None:
    """The KafkaError inside a KafkaException (None for anything else)."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def raise_partition_errors(partitions: Iterable[Any], what: str) -> None:
    """Raise KafkaException for the first of ``partitions`` (TopicPartitions a call such as
    ``committed()`` returned) that carries an error. Such a partition's offset is
    OFFSET_INVALID, which reads exactly like "nothing committed": taken for that, a restore
    would start a task over (``--reset-state`` would delete its checkpoints) and a ledger would
    commit again."""
    for tp in partitions:
        if tp.error is not None:
            error = tp.error if isinstance(tp.error, KafkaError) else KafkaError(tp.error)
            raise KafkaException(
                KafkaError(
                    error.code(),
                    f"{what}: {tp.topic}[{tp.partition}]: {error.str()}",
                    retriable=error.retriable(),
                )
            )


def is_unavailable(error: KafkaError) -> bool:
    """The error says the broker or a coordinator is unreachable right now."""
    return error.code() in _UNAVAILABLE


class KafkaClientError(SnaplineError):
    """A Kafka client of this worker cannot go on (fatal error, hung call, broker gone too
    long). The worker exits with EX_TEMPFAIL; a restarted worker recovers from the committed
    checkpoint."""

    exit_code = EX_TEMPFAIL


class BrokerOutageError(CheckpointError):
    """A checkpoint could not commit because the broker was unreachable. The worker waits for
    the broker, then aborts the epoch and restores; this does not count as a failed checkpoint
    against ``tolerable_failed_checkpoints``."""


class BoundedCall:
    """Runs blocking client calls of one client on a helper thread, waiting at most a bound.

    After one call outlived its bound the client is left alone for good (``hung`` names the
    call); every later call raises :class:`KafkaClientError` at once.

    ``inline``: true while the calling thread is inside a callback that this client runs from
    one of its own calls (a rebalance callback runs inside ``consume``). Such a call runs on
    the calling thread: from confluent-kafka 2.16 a Consumer lets one thread at a time into
    its calls and admits the thread already inside again (confluent-kafka-python #2322), so
    a helper thread would wait at that gate for ``consume``, which waits for the helper. A
    call made there cannot be left behind when it hangs; a timer ends the process once the
    bound is over (exit :data:`EX_TEMPFAIL`), as a hung call ends the worker otherwise."""

    def __init__(
        self,
        client: str,
        liveness: Liveness | None = None,
        inline: Callable[[], bool] | None = None,
    ) -> None:
        self.client = client
        self.hung: str | None = None
        #: Told of each wait: a call within its bound is not a stalled task thread.
        self.liveness = liveness
        self.inline = inline

    def __call__(self, what: str, bound: float, fn: Callable[..., T], *args: Any) -> T:
        if self.hung is not None:
            raise KafkaClientError(
                f"{self.client}: {what} not attempted, the client is stuck in {self.hung}"
            )
        if self.liveness is not None:
            self.liveness.allow(bound)
        if self.inline is not None and self.inline():
            return self._inline(what, bound, fn, *args)
        outcome: list[Any] = []
        done = threading.Event()

        def target() -> None:
            try:
                outcome.append((True, fn(*args)))
            except BaseException as exc:  # handed to the waiting thread
                outcome.append((False, exc))
            finally:
                done.set()

        thread = threading.Thread(target=target, name=f"kafka-{what}", daemon=True)
        thread.start()
        # Event.wait is interrupted by signals: SIGTERM's handler runs while we wait.
        if not done.wait(bound):
            self.hung = what
            raise KafkaClientError(self._hung_message(what, bound))
        ok, value = outcome[0]
        if ok:
            return value
        raise value

    def _inline(self, what: str, bound: float, fn: Callable[..., T], *args: Any) -> T:
        """The call on this thread, and a timer that ends the process if it outlives the
        bound (the client releases the GIL while it waits, so the timer runs)."""

        def hung() -> None:
            log.error(
                "%s (exit %d: restart the worker)", self._hung_message(what, bound), EX_TEMPFAIL
            )
            exit_now(EX_TEMPFAIL)

        timer = threading.Timer(bound, hung)
        timer.name = f"kafka-{what}-bound"
        timer.daemon = True
        timer.start()
        try:
            return fn(*args)
        finally:
            timer.cancel()

    def _hung_message(self, what: str, bound: float) -> str:
        return (
            f"{self.client}: {what} did not return within {bound:.0f}s (librdkafka can "
            "block past its timeout while a coordinator is unreachable, librdkafka "
            "#5456); exiting so that a fresh worker recovers from the committed checkpoint"
        )


def backoff(attempt: int, *, base: float = 0.2, cap: float = 5.0) -> float:
    """Exponential backoff: 0.2 s, 0.4 s, ... at most ``cap``."""
    return float(min(cap, base * 2 ** min(attempt, 16)))


def sleep_unless(stopping: Callable[[], bool], seconds: float) -> None:
    """Sleep ``seconds`` in small steps; return early once ``stopping()`` is true."""
    end = time.monotonic() + seconds
    while not stopping():
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.1))


def release_in_background(holder: list[Any]) -> None:
    """Drop a retired client on a helper thread: librdkafka's destructor may block while the
    broker is gone, and never on the task thread. ``holder`` must hold the only reference
    (callers ``del`` their own names first)."""
    threading.Thread(target=_release, args=(holder,), name="kafka-release", daemon=True).start()


def _release(holder: list[Any]) -> None:
    """Runs on the helper thread, which takes and drops the last reference."""
    client = holder.pop()
    del client


def delete_records(admin: AdminClient, below: list[Any], **options: Any) -> dict[Any, Any]:
    """``admin.delete_records(below, **options)``: the futures by partition, with the list
    ``below`` kept alive.

    confluent-kafka's C ``delete_records`` drops a reference to the list of partitions it is
    given, a reference it never took (``Py_XDECREF`` of an argument parsed as borrowed).
    Measured: 2.5.3, 2.12.2 (what the README installs: Quix Streams pins ``<2.13``), 2.13.0,
    2.14.0 and 2.15.0 drop one; 2.15.1 and 2.16.1 do not. The list is then freed while its
    owners still hold it, and the process's heap is corrupt from there: workers, which delete
    consumed repartition records at every checkpoint, died of SIGSEGV or SIGABRT seconds to
    minutes later, anywhere (seen: in ``min()``, in building a dict, in ``orjson.dumps``, in
    a Future's waiters on the librdkafka background thread). So the list gets one reference
    added for the library to drop; a release that drops none gives it back here."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(below))
    held = sys.getrefcount(below)
    try:
        return admin.delete_records(below, **options)
    finally:
        if sys.getrefcount(below) >= held:  # nothing was dropped: this one is ours
            ctypes.pythonapi.Py_DecRef(ctypes.py_object(below))


#: Group states without members (UNKNOWN, from a broker that does not say, may have some).
_MEMBERLESS = {ConsumerGroupState.EMPTY, ConsumerGroupState.DEAD}


def listed_groups(admin: AdminClient, timeout: float, wanted: Iterable[str]) -> dict[str, bool]:
    """The consumer groups of the cluster, and whether each may have members now, by
    ListGroups: each broker answers for the groups it coordinates, with no coordinator lookup.

    A group request that looks a coordinator up (DescribeGroups, OffsetFetch) and times out
    while the lookup is in flight can abort the process later (librdkafka #4605:
    ``rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0' failed``; workers
    started while a cluster was coming up died with -6 in the bounce tests). So a check asks
    this first and sends such requests only for the groups it names. Raises KafkaException
    when a broker did not answer and one of the ``wanted`` groups was not listed (it could
    live on that broker)."""
    result = admin.list_consumer_groups(request_timeout=timeout).result(timeout=timeout + 5)
    listed = {g.group_id: g.state not in _MEMBERLESS for g in result.valid}
    if result.errors and any(group not in listed for group in wanted):
        error = result.errors[0]
        raise error if isinstance(error, KafkaException) else KafkaException(error)
    return listed
