"""The worker's Kafka output: one transactional producer whose transaction is the commit point.

Epochs: records of checkpoint epoch n go into Kafka transaction n. While checkpoint n is
still materializing, tasks that already passed barrier n produce epoch n+1 records; those are
held in memory and sent when transaction n+1 begins, right after n commits. At-least-once
mode has no transactions: records are sent at once and flushed before offsets are committed.

Every transactional call is bounded (``kafka_calls.BoundedCall``) and its errors classified:
retriable ones are retried with backoff within the call's bound, abortable ones fail the
checkpoint (the worker aborts the epoch and restores), fatal ones raise :class:`FencedError`.

Threads: only the task (main) thread calls this class; each blocking librdkafka call runs on a
helper thread that the task thread waits for (see ``kafka_calls``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from snapline.connectors.config import redact
from snapline.pipeline.errors import CheckpointError, ConfigurationError
from snapline.pipeline.runtime.kafka_calls import (
    HANG_GRACE,
    BoundedCall,
    BrokerOutageError,
    ErrorClass,
    KafkaClientError,
    backoff,
    classify,
    is_unavailable,
    kafka_error,
    release_in_background,
    sleep_unless,
)
from snapline.pipeline.runtime.liveness import Liveness

log = logging.getLogger(__name__)

#: Bound of one commit (send offsets + commit) and of init_transactions attempts.
COMMIT_TIMEOUT = 30.0
#: Bound of an abort before it is left pending until the next begin (broker unreachable).
ABORT_TIMEOUT = 10.0
#: Bound of init_transactions (also when completing a pending abort after an outage).
INIT_TIMEOUT = 120.0
#: librdkafka timeout of one attempt of a transactional call.
ATTEMPT_TIMEOUT = 5.0
#: Bound of a pending abort completed by ``begin``. Past it the producer is replaced: begin
#: runs after the worker rejoined its group (the broker answers), and an abort that still
#: times out then is stuck inside librdkafka ("retry call to resume" forever, seen in a
#: bounce-test run); a new producer's init_transactions ends the transaction instead.
PENDING_ABORT_BOUND = 15.0


class FencedError(KafkaClientError, CheckpointError):
    """The producer hit a fatal error: fenced by another incarnation of this worker, or its
    epoch bumped by the broker when it aborted a transaction that outlived
    ``transaction.timeout.ms`` (a long broker outage). The checkpoint fails; the next abort or
    begin replaces the producer (its ``init_transactions`` aborts whatever is left open)."""


class TransactionFailedError(CheckpointError):
    """Exactly-once: the open transaction failed (librdkafka refuses further records with
    "Erroneous state" once, e.g., the broker refused a batch). The checkpoint fails: the epoch
    is aborted and the tasks restore from the committed checkpoint."""


#: The most bytes librdkafka adds to a record's key, value and headers when it checks the
#: record against ``message.max.bytes`` (RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD, rounded up).
RECORD_OVERHEAD = 40

#: The producer's ``transaction.timeout.ms`` unless the job needs more (``transaction_timeout``).
TRANSACTION_TIMEOUT_MS = 60_000
#: A transaction is open from one commit to the next: a checkpoint interval, then the
#: checkpoint (alignment, snapshot, pre-commit: at most ``checkpoint_timeout``), then the
#: commit, for which this much is left.
COMMIT_ALLOWANCE_MS = 10_000
#: The brokers' default ``transaction.max.timeout.ms`` (15 minutes): a producer asking for
#: more is refused (INVALID_TRANSACTION_TIMEOUT, fatal).
BROKER_MAX_TRANSACTION_TIMEOUT_MS = 900_000


def transaction_timeout(
    config: dict[str, Any], checkpoint_interval: float, checkpoint_timeout: float
) -> int:
    """The ``transaction.timeout.ms`` an exactly-once job's producer needs: longer than a
    checkpoint interval plus its checkpoint (up to ``checkpoint_timeout``) plus the commit,
    since each transaction stays open that long. Left at 60 s, a job checkpointing every
    minute or more never committed: the broker aborted each transaction before its commit,
    which then failed as fenced, and every restart again. Raised to what the job needs when
    the config does not set it (71 s with the defaults). A setting is kept (tests and short
    checkpoints may want less) unless it is no longer than the interval, which no checkpoint
    fits: that, or a need above the brokers' default maximum, is a ConfigurationError naming
    the fix."""
    interval_ms = int(checkpoint_interval * 1000)
    needed = interval_ms + int(checkpoint_timeout * 1000) + COMMIT_ALLOWANCE_MS
    given = config.get("transaction.timeout.ms")
    if given is not None:
        try:
            value = int(given)
        except (TypeError, ValueError):
            raise ConfigurationError(
                f"kafka_config transaction.timeout.ms={given!r} is not a number of ms"
            ) from None
        if value < interval_ms + 1000:
            raise ConfigurationError(
                f"kafka_config transaction.timeout.ms={value} is not longer than a checkpoint "
                f"interval ({checkpoint_interval:g} s) and its checkpoint: each Kafka "
                "transaction stays open that long, and the broker would abort every one "
                f"before its commit. Set it to {needed} or more, or lower checkpoint_interval"
            )
        if value < needed:
            log.warning(
                "kafka_config transaction.timeout.ms=%d: a checkpoint that takes longer than "
                "%.0f s (checkpoint_timeout allows %g s) has its transaction aborted by the "
                "broker and fails as fenced; %d fits every checkpoint",
                value,
                max(0, value - interval_ms - COMMIT_ALLOWANCE_MS) / 1000,
                checkpoint_timeout,
                needed,
            )
        return value
    if needed > BROKER_MAX_TRANSACTION_TIMEOUT_MS:
        raise ConfigurationError(
            f"checkpoint_interval={checkpoint_interval:g} plus checkpoint_timeout="
            f"{checkpoint_timeout:g} keeps a Kafka transaction open longer than the brokers' "
            "default transaction.max.timeout.ms (15 min) allows: lower them (together at most "
            f"{(BROKER_MAX_TRANSACTION_TIMEOUT_MS - COMMIT_ALLOWANCE_MS) // 1000} s), or raise "
            "transaction.max.timeout.ms on the brokers and set transaction.timeout.ms (at "
            f"least {needed}) in kafka_config"
        )
    return max(TRANSACTION_TIMEOUT_MS, needed)


def too_large(size: int, limit: int) -> KafkaException:
    """The error librdkafka's produce raises for a record over ``message.max.bytes``: for
    records held before they reach the producer, refused as it would refuse them."""
    return KafkaException(
        KafkaError(
            KafkaError.MSG_SIZE_TOO_LARGE,
            f"Message size {size} exceeds message.max.bytes {limit}",
        )
    )


def record_size(value: bytes | None, key: bytes | None, headers: Any = None) -> int:
    """The size librdkafka checks against ``message.max.bytes`` (at least: each header counts
    its name and value plus 10 bytes of framing)."""
    size = RECORD_OVERHEAD + (0 if value is None else len(value)) + (0 if key is None else len(key))
    for name, header in headers or ():
        size += len(name) + (0 if header is None else len(header)) + 10
    return size


#: Seconds the check before a fenced producer is replaced may take, for the liveness
#: watchdog. ``may_refence`` (``departed.check_no_namesake``) lists the groups (up to 15 s:
#: 10 s for the request, 5 s more for its result), then describes the ones with members
#: (up to 10 s).
REFENCE_CHECK_BOUND = 30.0


class TransactionalOutput:
    """Produces records into the open epoch's transaction, buffering later epochs."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        transactional_id: str | None,
        stopping: Callable[[], bool] = lambda: False,
        liveness: Liveness | None = None,
    ) -> None:
        self.exactly_once = transactional_id is not None
        conf = {
            "linger.ms": 5,
            "batch.num.messages": 10000,
            "queue.buffering.max.messages": 1000000,
            "queue.buffering.max.kbytes": 1048576,
            "compression.type": "lz4",
            "partitioner": "murmur2_random",
            "enable.idempotence": True,
            **config,
        }
        if transactional_id is not None:
            conf["transactional.id"] = transactional_id
            conf.setdefault("transaction.timeout.ms", TRANSACTION_TIMEOUT_MS)
        # Only failed deliveries are reported: a delivered record leaves no event for poll()
        # to serve. A failed one still fails the commit point: at-least-once through
        # on_delivery and flush, exactly-once through commit_transaction.
        conf.setdefault("delivery.report.only.error", True)
        log.debug("producer config %s", redact(conf))
        self._delivery_errors: list[str] = []
        conf["error_cb"] = self._on_error
        if not self.exactly_once:
            conf["on_delivery"] = self._on_delivery
        self._conf = conf
        #: librdkafka refuses a record whose key and value exceed this (MSG_SIZE_TOO_LARGE);
        #: records held for a later epoch are checked against it when they are held.
        self.max_message_bytes = int(conf.get("message.max.bytes", 1_000_000))
        self._stopping = stopping
        self._liveness = liveness
        self._call = BoundedCall("producer", liveness)
        self.producer = _new_producer(conf)
        #: Why the producer failed fatally; it is replaced before its next transaction.
        self._fatal: str | None = None
        #: New record size limits (``resize``) the producer takes by being replaced, as a
        #: fatal failure's is (exactly-once: at the next begin or abort).
        self._resized: dict[str, int] | None = None
        self.replaced = 0
        #: Called before an exactly-once producer is replaced (the new one's
        #: init_transactions fences whoever holds the transactional id now); it raises to stop
        #: the worker instead. Its error is kept: the fenced producer is never replaced after.
        self.may_refence: Callable[[], None] | None = None
        self._refused: Exception | None = None
        self.open_epoch: int | None = None
        #: An abort that could not reach the broker; completed before the next begin.
        self._abort_pending = False
        self._buffer: list[tuple[int, str, bytes | None, bytes | None, Any, int, int]] = []
        self.produced = 0
        #: Bounds of commit and abort; the worker shortens them once a stop is requested.
        self.commit_timeout = COMMIT_TIMEOUT
        self.abort_timeout = ABORT_TIMEOUT

    @property
    def held(self) -> int:
        """Records held for epochs whose transaction has not begun yet."""
        return len(self._buffer)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._delivery_errors.append(str(err))
        log.warning("kafka producer: %s", err)

    def _on_delivery(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self._delivery_errors.append(f"{msg.topic()}: {err}")

    def _retry(self, what: str, timeout: float, fn: Callable[[float], None]) -> None:
        """Call ``fn(timeout_left)`` until it succeeds, retrying retriable errors with backoff
        until ``timeout`` s have passed. Raises FencedError (fatal), BrokerOutageError (the
        broker stayed unreachable) or CheckpointError (abortable)."""
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            # Short attempts: a stop request is noticed between them (a timed-out call is
            # retriable and resumes where it was).
            left = min(max(deadline - time.monotonic(), 1.0), ATTEMPT_TIMEOUT)
            try:
                self._call(what, left + HANG_GRACE, fn, left)
                return
            except KafkaException as exc:
                error = kafka_error(exc)
                if error is None:
                    raise CheckpointError(f"Kafka {what} failed: {exc}") from exc
                if error.code() == KafkaError.INVALID_TRANSACTION_TIMEOUT:
                    # Fatal for the producer, and no restart fixes it: the job's setting.
                    raise ConfigurationError(
                        f"the brokers refuse transaction.timeout.ms="
                        f"{self._conf.get('transaction.timeout.ms')} ({error.str()}): it is "
                        "above their transaction.max.timeout.ms. Lower checkpoint_interval (a "
                        "transaction lasts an interval and its checkpoint), or raise "
                        "transaction.max.timeout.ms on the brokers"
                    ) from exc
                fenced = self._fenced(what, exc)
                if fenced is not None:
                    raise fenced from exc
                kind = classify(error)
                if error.code() == KafkaError._CONFLICT:
                    # Another call is still in progress inside librdkafka (a commit that
                    # timed out): librdkafka marks this retriable, but the same call is
                    # refused until that one ends. Retrying it only spent the whole bound
                    # before the producer was replaced (_finish_abort).
                    kind = ErrorClass.ABORTABLE
                out_of_time = time.monotonic() + backoff(attempt) >= deadline or self._stopping()
                if kind is ErrorClass.RETRIABLE and not out_of_time:
                    log.info("%s: %s; retrying", what, error)
                    sleep_unless(self._stopping, backoff(attempt))
                    attempt += 1
                    continue
                if is_unavailable(error):
                    raise BrokerOutageError(
                        f"Kafka {what} could not reach the broker within {timeout:.0f}s: {error}"
                    ) from exc
                raise CheckpointError(f"Kafka {what} failed: {error}") from exc

    def init(self, timeout: float = INIT_TIMEOUT) -> None:
        """Register the transactional id: fences and aborts any previous incarnation."""
        if not self.exactly_once:
            return
        try:
            self._retry("init_transactions", timeout, self.producer.init_transactions)
        except (BrokerOutageError, CheckpointError) as exc:
            if isinstance(exc, KafkaClientError):
                raise
            raise KafkaClientError(
                f"producer: init_transactions did not complete within {timeout:.0f}s ({exc}); "
                "is the broker reachable?"
            ) from exc

    def begin(self, epoch: int) -> None:
        """Open the transaction of ``epoch`` and send the records held for it."""
        if self.exactly_once:
            if self._fatal is not None or self._resized is not None:
                self._replace_producer()
            if self._abort_pending:
                self._finish_abort(PENDING_ABORT_BOUND, replace_if_stuck=True)
            try:
                self.producer.begin_transaction()
            except KafkaException as exc:
                error = kafka_error(exc)
                if error is not None and classify(error) is ErrorClass.FATAL:
                    self._fatal = f"begin_transaction: {error}"
                    raise FencedError(f"producer: begin_transaction: {error}") from exc
                raise CheckpointError(f"Kafka begin_transaction failed: {exc}") from exc
        self._open(epoch)

    def continue_epoch(self, epoch: int) -> None:
        """The checkpoint of the open epoch failed before the commit point, but its
        transaction is intact: it takes ``epoch`` too (the records held for it are sent now),
        and the next checkpoint commits both."""
        if self.exactly_once and self.open_epoch is None:
            raise CheckpointError("no open transaction to continue")
        self._open(epoch)

    def _open(self, epoch: int) -> None:
        self.open_epoch = epoch
        held, self._buffer = self._buffer, []
        if not held:
            return
        # Records of an epoch whose transaction had not begun (only exactly-once holds any),
        # often a fifth of all output (those produced while the previous checkpoint
        # completed): the common case (no headers, partitioner's choice) goes straight to
        # the producer.
        produce = self.producer.produce
        sent = 0
        for item in held:
            if item[0] != epoch:
                self._buffer.append(item)
                continue
            if item[5] < 0 and not item[4]:
                try:
                    produce(item[1], item[2], item[3])
                    sent += 1
                    continue
                except (BufferError, KafkaException):
                    pass  # not taken: _send waits for room or classifies the error
            self._send(*item[1:])
        if sent:
            self.produced += sent
            self.poll()

    def produce(
        self,
        epoch: int,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: Any = None,
        partition: int = -1,
        timestamp: int = 0,
    ) -> None:
        """A record of ``epoch``; ``partition`` -1: the partitioner decides; ``timestamp`` 0:
        the producer's time."""
        if epoch == self.open_epoch or not self.exactly_once:
            self._send(topic, value, key, headers, partition, timestamp)
        elif self.open_epoch is not None and epoch < self.open_epoch:
            raise CheckpointError(f"record of epoch {epoch} after epoch {self.open_epoch} opened")
        else:
            # Held records live until the checkpoint commits: keep exact-size copies, not
            # the encoder's (orjson's) 4 KiB buffers behind each small value.
            held = None if value is None else b"%b" % value
            if headers:
                size = record_size(value, key, headers)
            else:  # record_size, inlined (a fifth of all output can be held)
                size = (
                    RECORD_OVERHEAD
                    + (0 if value is None else len(value))
                    + (0 if key is None else len(key))
                )
            if size > self.max_message_bytes:  # refused now, as librdkafka would refuse it
                raise too_large(size, self.max_message_bytes)
            self._buffer.append((epoch, topic, held, key, headers, partition, timestamp))

    def _send(
        self,
        topic: str,
        value: bytes | None,
        key: bytes | None,
        headers: Any,
        partition: int = -1,
        timestamp: int = 0,
    ) -> None:
        # No per-record delivery callback: exactly-once, a failed delivery fails
        # commit_transaction; at-least-once, the producer's on_delivery reports failures.
        while True:
            try:
                if partition >= 0:
                    self.producer.produce(
                        topic, value, key, partition=partition, timestamp=timestamp, headers=headers
                    )
                elif headers:
                    self.producer.produce(topic, value, key, headers=headers)
                else:
                    self.producer.produce(topic, value, key)
                break
            except BufferError:
                self.poll(0.05)
            except KafkaException as exc:
                fenced = self._fenced("produce", exc)
                if fenced is not None:
                    raise fenced from exc
                error = kafka_error(exc)
                if self.exactly_once and error is not None and error.code() == KafkaError._STATE:
                    raise TransactionFailedError(
                        f"the open transaction failed; producer: {error.str()}"
                    ) from exc
                raise
        self.produced += 1
        if self.produced & 0x3FF == 0:
            self.poll()

    def direct_producer(self, epoch: int) -> Producer | None:
        """The producer itself when records of ``epoch`` go straight to it (at-least-once,
        or exactly-once with its transaction open), else None. A sink's batch loop may call
        ``produce(topic, value, key)`` on it, fall back to :meth:`produce` on BufferError,
        and report what it sent with :meth:`sent` (one Python call less per record)."""
        if epoch == self.open_epoch or not self.exactly_once:
            return self.producer
        return None

    def sent(self, count: int) -> None:
        """``count`` records went straight to the producer (see :meth:`direct_producer`)."""
        self.produced += count
        self.poll()

    def poll(self, timeout: float = 0) -> None:
        """Serve the producer's callbacks; raises FencedError once it failed fatally."""
        try:
            self.producer.poll(timeout)
        except KafkaException as exc:
            fenced = self._fenced("poll", exc)
            if fenced is None:
                raise
            raise fenced from exc

    def _fenced(self, what: str, exc: KafkaException) -> FencedError | None:
        """What to raise instead of ``exc`` out of a producer call (the transactional calls,
        ``produce``, ``poll``). A transactional producer fenced, even while the epoch ran (e.g.
        a survivor aborted this worker's transaction while it was out of the group), refuses
        every call with a fatal error: FencedError fails the epoch, whose abort replaces the
        producer, and the worker restores in the same process. None: ``exc`` stays as it is."""
        error = kafka_error(exc)
        if self.exactly_once and error is not None and classify(error) is ErrorClass.FATAL:
            self._fatal = f"{what}: {error}"
            return FencedError(f"producer: {what} failed fatally: {error}")
        return None

    def commit(
        self,
        offsets: list[TopicPartition],
        group_metadata: Any,
        timeout: float | None = None,
        offsets_sent: Callable[[], None] | None = None,
    ) -> None:
        """The commit point: the epoch's records and the source offsets, atomically.

        The group coordinator checks the consumer generation in ``group_metadata`` when the
        offsets are sent, so a worker that lost its partitions (a zombie) fails here. One
        that sent them while still a member and then stalled holds the partitions' committed
        offsets "unstable": the new owner's offset fetch (read_committed, KIP-447) waits until
        this transaction commits or times out.

        Bounded by ``timeout`` (default ``commit_timeout``): an unreachable broker raises
        BrokerOutageError, and the transaction stays open (open_epoch is kept) so that
        abort() aborts it."""
        if not self.exactly_once:
            raise CheckpointError("commit() is only for exactly-once; use flush()")
        timeout = self.commit_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            if offsets:

                def send(left: float) -> None:
                    self.producer.send_offsets_to_transaction(offsets, group_metadata, left)

                self._retry("send_offsets_to_transaction", timeout, send)
            if offsets_sent is not None:
                offsets_sent()
            left = max(deadline - time.monotonic(), 5.0)
            self._retry("commit_transaction", left, self.producer.commit_transaction)
        except FencedError:
            self.open_epoch = None
            raise
        self.open_epoch = None
        if self._delivery_errors:
            errors, self._delivery_errors = self._delivery_errors, []
            raise CheckpointError(f"records failed delivery: {errors[:3]}")

    def flush(self, timeout: float = 60.0) -> None:
        """At-least-once: wait until every record is acknowledged. Records still waiting
        after ``timeout`` are an outage (BrokerOutageError: waited out, not counted as a failed
        checkpoint); records refused are a CheckpointError."""
        remaining = self._call("flush", timeout + HANG_GRACE, self.producer.flush, timeout)
        if remaining:
            raise BrokerOutageError(
                f"{remaining} records not delivered within {timeout}s; is the broker reachable?"
            )
        if self._delivery_errors:
            errors, self._delivery_errors = self._delivery_errors, []
            raise CheckpointError(f"records failed delivery: {errors[:3]}")

    def abort(self) -> None:
        """Discard the open transaction and everything held for later epochs.

        When the broker cannot be reached within ``abort_timeout`` the abort is left pending
        and completed by the next begin(): the worker keeps waiting for the broker instead of
        failing. A producer that failed fatally (e.g. its epoch was bumped when the broker
        timed the transaction out during an outage) raises FencedError."""
        self._buffer = []
        self._delivery_errors = []
        if self._refused is not None:
            # Fenced by another job's worker with this transactional id, whose
            # init_transactions ended this producer's transaction; it stays fenced.
            self.open_epoch = None
            return
        if self.exactly_once and (self._fatal is not None or self._resized is not None):
            self._replace_producer()  # its init_transactions aborts the open transaction
        if self.exactly_once and (self.open_epoch is not None or self._abort_pending):
            self.open_epoch = None
            self._abort_pending = True
            self._finish_abort(self.abort_timeout, leave_pending=True)
        self.open_epoch = None

    def resize(self, limits: dict[str, int]) -> bool:
        """New record size limits (``message.max.bytes``, ``batch.size``): a topic's
        ``max.message.bytes`` was lowered while the worker ran. The producer is replaced with
        them: now when at-least-once, at the next ``begin`` (or ``abort``) when exactly-once,
        whose open transaction the new producer's init_transactions aborts. False when the
        producer has these limits already."""
        if all(self._conf.get(name) == value for name, value in limits.items()):
            return False
        self._conf.update(limits)
        self.max_message_bytes = int(self._conf.get("message.max.bytes", 1_000_000))
        self._resized = limits
        if not self.exactly_once:
            self._replace_producer()
        return True

    def _replace_producer(self) -> None:
        """A fresh producer with the same transactional id instead of one that failed fatally
        (or is stuck in a commit_transaction that timed out, or has outdated record size
        limits: ``resize``).

        Its init_transactions bumps the epoch, aborting the transaction the old one left open,
        so nothing of the failed epoch becomes visible; a commit the coordinator had already
        logged completes instead, offsets included, and recovery restores from it. A later
        incarnation of this worker holding the id is not fenced in turn: ``may_refence``
        (the worker's incarnation check) stops this one first."""
        if self._refused is not None:
            raise self._refused
        if self.exactly_once and self.may_refence is not None:
            # Every replacement's init_transactions fences whoever holds the id now (a
            # resize's too), so every one is checked.
            if self._liveness is not None:
                self._liveness.allow(REFENCE_CHECK_BOUND)  # Kafka calls, bounded
            try:
                self.may_refence()
            except Exception as exc:
                self._refused = exc
                raise
        if self._fatal is not None:
            log.warning("producer cannot go on (%s); replacing it", self._fatal)
        else:
            log.info("replacing the producer for new record size limits %s", self._resized)
        old = self.producer
        self.producer = Producer(self._conf)
        self._call = BoundedCall("producer", self._liveness)
        self.open_epoch = None
        self._abort_pending = False
        self._fatal = None
        self._resized = None
        self._delivery_errors = []  # the old producer's; its transaction is aborted
        self.replaced += 1
        holder: list[object] = [old]
        del old
        release_in_background(holder)
        self.init()

    def _finish_abort(
        self, timeout: float, *, leave_pending: bool = False, replace_if_stuck: bool = False
    ) -> None:
        try:
            self._retry("abort_transaction", timeout, self.producer.abort_transaction)
        except FencedError:
            self._replace_producer()
            return
        except BrokerOutageError as exc:
            if replace_if_stuck:
                # A new producer's init_transactions (bounded by INIT_TIMEOUT) ends the
                # transaction as after a restart: the coordinator aborts it.
                self._fatal = f"abort_transaction still not done: {exc}"
                self._replace_producer()
                return
            if not leave_pending:
                raise
            log.warning("%s; the abort completes when the broker is back", exc)
            return
        except CheckpointError as exc:
            error = kafka_error(exc.__cause__) if exc.__cause__ is not None else None
            if error is not None and error.code() == KafkaError._CONFLICT:
                # A commit_transaction that timed out still runs inside librdkafka ("retry
                # call to resume"); the worker gave its epoch up, and this producer can
                # neither abort nor begin. A fresh producer's init_transactions settles the
                # transaction as after a restart: the coordinator completes a commit it had
                # logged, else aborts. Recovery then reads the offsets that count.
                self._fatal = f"abort_transaction: {error}"
                self._replace_producer()
                return
            # e.g. no transaction in progress: nothing left to abort
            log.warning("abort_transaction: %s", exc)
        self._abort_pending = False

    def close(self, timeout: float = 10.0) -> None:
        start = time.monotonic()
        try:
            self._call("flush", timeout + HANG_GRACE, self.producer.flush, timeout)
        except (KafkaClientError, KafkaException) as exc:
            log.warning("producer close: %s", exc)
        log.debug("producer closed in %.3fs", time.monotonic() - start)


def _new_producer(conf: dict[str, Any]) -> Producer:
    """A producer; librdkafka's refusal of the settings (``acks=1`` with idempotence, a bad
    value) is a ConfigurationError naming the fix, not a traceback the supervisor restarts."""
    try:
        return Producer(conf)
    except KafkaException as exc:
        raise invalid_kafka_settings(exc, "producer") from exc


def invalid_kafka_settings(exc: KafkaException, client: str) -> Exception:
    """The ConfigurationError for a Kafka client librdkafka refused to create (invalid
    settings); other errors as they were."""
    error = kafka_error(exc)
    if error is None or error.code() != KafkaError._INVALID_ARG:
        return exc
    return ConfigurationError(
        f"invalid Kafka settings for the {client}: {error.str()}; fix it in the pipeline's "
        "kafka_config (settings: librdkafka's CONFIGURATION.md; Snapline sets acks=all, "
        "enable.idempotence and transactions itself)"
    )
