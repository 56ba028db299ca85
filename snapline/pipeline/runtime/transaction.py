"""The worker's Kafka output: one transactional producer whose transaction is the commit point.

Epochs: records of checkpoint epoch n go into Kafka transaction n. While checkpoint n is
still materializing, tasks that already passed barrier n produce epoch n+1 records; those are
held in memory and sent when transaction n+1 begins, right after n commits. At-least-once
mode has no transactions: records are sent at once and flushed before offsets are committed.

Threads: only the task (main) thread calls this class.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from snapline.connectors.config import redact
from snapline.pipeline.errors import CheckpointError

log = logging.getLogger(__name__)


class FencedError(CheckpointError):
    """Another incarnation of this worker took over its transactional id; stop now."""


class TransactionalOutput:
    """Produces records into the open epoch's transaction, buffering later epochs."""

    def __init__(self, config: dict[str, Any], *, transactional_id: str | None) -> None:
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
            conf.setdefault("transaction.timeout.ms", 60000)
        log.debug("producer config %s", redact(conf))
        self._delivery_errors: list[str] = []
        conf["error_cb"] = self._on_error
        self.producer = Producer(conf)
        self.open_epoch: int | None = None
        self._buffer: list[tuple[int, str, bytes | None, bytes | None, Any]] = []
        self.produced = 0

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

    def init(self, timeout: float = 60.0) -> None:
        """Register the transactional id: fences and aborts any previous incarnation."""
        if self.exactly_once:
            self.producer.init_transactions(timeout)

    def begin(self, epoch: int) -> None:
        """Open the transaction of ``epoch`` and send the records held for it."""
        if self.exactly_once:
            self.producer.begin_transaction()
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
        for item in held:
            if item[0] == epoch:
                self._send(*item[1:])
            else:
                self._buffer.append(item)

    def produce(
        self, epoch: int, topic: str, value: bytes | None, key: bytes | None, headers: Any = None
    ) -> None:
        if epoch == self.open_epoch or not self.exactly_once:
            self._send(topic, value, key, headers)
        elif self.open_epoch is not None and epoch < self.open_epoch:
            raise CheckpointError(f"record of epoch {epoch} after epoch {self.open_epoch} opened")
        else:
            # Held records live until the checkpoint commits: keep exact-size copies, not
            # the encoder's (orjson's) 4 KiB buffers behind each small value.
            held = None if value is None else b"%b" % value
            self._buffer.append((epoch, topic, held, key, headers))

    def _send(self, topic: str, value: bytes | None, key: bytes | None, headers: Any) -> None:
        # Exactly-once needs no per-record delivery callback: a failed delivery fails
        # commit_transaction. At-least-once checks every delivery before committing offsets.
        callback = None if self.exactly_once else self._on_delivery
        while True:
            try:
                if headers:
                    self.producer.produce(topic, value, key, headers=headers, on_delivery=callback)
                elif callback is None:
                    self.producer.produce(topic, value, key)
                else:
                    self.producer.produce(topic, value, key, on_delivery=callback)
                break
            except BufferError:
                self.producer.poll(0.05)
        self.produced += 1
        if self.produced & 0x3FF == 0:
            self.producer.poll(0)

    def poll(self) -> None:
        self.producer.poll(0)

    def commit(
        self,
        offsets: list[TopicPartition],
        group_metadata: Any,
        timeout: float = 60.0,
        offsets_sent: Callable[[], None] | None = None,
    ) -> None:
        """The commit point: the epoch's records and the source offsets, atomically.

        The group coordinator checks the consumer generation in ``group_metadata`` when the
        offsets are sent, so a worker that lost its partitions (a zombie) fails here. One
        that sent them while still a member and then stalled holds the partitions' committed
        offsets "unstable": the new owner's offset fetch (read_committed, KIP-447) waits until
        this transaction commits or times out."""
        if not self.exactly_once:
            raise CheckpointError("commit() is only for exactly-once; use flush()")
        try:
            if offsets:
                self.producer.send_offsets_to_transaction(offsets, group_metadata, timeout)
            if offsets_sent is not None:
                offsets_sent()
            self.producer.commit_transaction(timeout)
        except KafkaException as exc:
            error = exc.args[0]
            if isinstance(error, KafkaError) and error.fatal():
                self.open_epoch = None
                raise FencedError(f"producer fenced or fatally failed: {error}") from exc
            # The transaction stays open (open_epoch is kept) so that abort() aborts it;
            # otherwise the next begin_transaction would fail in the abortable-error state.
            raise CheckpointError(f"Kafka commit failed: {error}") from exc
        self.open_epoch = None
        if self._delivery_errors:
            errors, self._delivery_errors = self._delivery_errors, []
            raise CheckpointError(f"records failed delivery: {errors[:3]}")

    def flush(self, timeout: float = 60.0) -> None:
        """At-least-once: wait until every record is acknowledged."""
        remaining = self.producer.flush(timeout)
        if remaining:
            raise CheckpointError(f"{remaining} records not delivered within {timeout}s")
        if self._delivery_errors:
            errors, self._delivery_errors = self._delivery_errors, []
            raise CheckpointError(f"records failed delivery: {errors[:3]}")

    def abort(self) -> None:
        """Discard the open transaction and everything held for later epochs."""
        self._buffer = []
        self._delivery_errors = []
        if self.exactly_once and self.open_epoch is not None:
            self.open_epoch = None
            try:
                self.producer.abort_transaction(30)
            except KafkaException as exc:
                error = exc.args[0]
                if isinstance(error, KafkaError) and error.fatal():
                    raise FencedError(f"producer fenced: {error}") from exc
                log.warning("abort_transaction: %s", error)
        self.open_epoch = None

    def close(self) -> None:
        start = time.monotonic()
        self.producer.flush(10)
        log.debug("producer closed in %.3fs", time.monotonic() - start)
