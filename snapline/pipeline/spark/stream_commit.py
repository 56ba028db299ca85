"""Exactly-once sinks of ``snapline spark stream``: ``foreachBatch`` commits each micro-batch
with the batch id as the idempotence key, with the services' two-phase-commit protocol.

Spark writes a batch's offsets to ``<checkpoint location>/offsets`` before running it and
marks it done in ``commits`` only after ``foreachBatch`` returned; a driver that dies in
between re-runs the same batch id over the same offsets from the previous state-store version
after a restart, so a batch may reach ``foreachBatch`` twice, with the same rows. Epoch
``e = batch id + 1`` is committed like a services checkpoint:

1. every sink writer gets the batch's rows; the sinks pre-commit (Parquet stages files,
   PostgreSQL stages rows) and their results go to ``<checkpoint dir>/<job>/spark-stream/
   <query>/<e>-<driver>.json``, the pre-commit record (``<driver>``: a token this driver drew
   at start);
2. one Kafka transaction carries the batch's Kafka output and the offset ``e`` of the ledger
   group ``snapline-spark-stream-<job>-<query>`` on the job's control topic, with the driver's
   token as the offset's metadata: the commit point;
3. Parquet publishes and PostgreSQL applies its upsert fenced by ``e``.

At start the driver calls ``init_transactions`` with the query's ``transactional.id``, which
fences every earlier driver of the query (its open transaction is aborted, it can never commit),
then reads the ledger: epoch ``L`` is the last committed one, and its metadata names the driver
whose pre-commit record is the committed one. A fenced driver may still write a record of an
epoch after it was fenced (it froze between its pre-commit and that write); the token keeps it
from replacing the record of the driver that committed the epoch. The sinks recover ``L``
(re-publish what its pre-commit record lists; discard staged data that ``L`` proves dead), and
a batch with ``e <= L`` writes nothing (it is the re-run of a batch committed before the
crash). ``<query>`` is Spark's query id (the checkpoint location's ``metadata``), so a new query
(a new or emptied location) starts a fresh ledger.

Threads: the Spark driver's ``foreachBatch`` thread calls ``commit_batch``; ``open`` runs on
the main thread before the query starts.
"""

from __future__ import annotations

import logging
import pickle
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import orjson

from snapline.pipeline.checkpoint.metadata import decode_checked, encode_checked
from snapline.pipeline.errors import SinkError
from snapline.pipeline.formats import untag_key
from snapline.pipeline.record import Record, dead_letter_headers
from snapline.pipeline.runtime.transaction import record_size
from snapline.pipeline.sink import SinkContext, SinkWriter
from snapline.pipeline.spark.stream_ops import OUT_FIELDS, output_order

log = logging.getLogger(__name__)

#: Group-coordinator errors a fresh or busy broker answers with for a while.
_COORDINATOR_ERRORS = (14, 15, 16)  # COORDINATOR_LOAD_IN_PROGRESS, _NOT_AVAILABLE, NOT_COORDINATOR


def query_id(checkpoint_location: str) -> str:
    """The id of the query at ``checkpoint_location``: Spark's own query id, from the
    location's ``metadata`` file, written here first for a new location (Spark then uses it).
    A new location (or one emptied by hand) is a new query with a new ledger, so a stale
    ledger of an earlier query can never make it skip a batch."""
    from snapline.pipeline.checkpoint.storage import CheckpointStorage

    storage = CheckpointStorage(checkpoint_location)
    if not storage.exists("metadata"):
        storage.write_bytes("metadata", orjson.dumps({"id": str(uuid.uuid4())}))
    return str(orjson.loads(storage.read_bytes("metadata"))["id"])


@dataclass(frozen=True)
class BatchResult:
    batch_id: int
    epoch: int
    rows: int
    #: False for a re-run of a batch committed before a restart (nothing written).
    written: bool
    seconds: float


class BatchCommitter:
    """The foreachBatch function and its state: writers, transactional producer, ledger."""

    def __init__(
        self,
        pipeline: Any,
        sinks: tuple[Any, ...],
        kafka_config: dict[str, Any],
        checkpoint_dir: str,
        checkpoint_location: str,
    ) -> None:
        self.pipeline = pipeline
        self.sinks = sinks
        self.kafka_config = kafka_config
        self.checkpoint_dir = checkpoint_dir
        self.query = query_id(checkpoint_location)
        self.task_id = f"spark-stream-{self.query}"
        self.ledger_group = f"snapline-spark-stream-{pipeline.name}-{self.query}"
        self.committed = 0
        #: This driver's token: its pre-commit records and its ledger commits carry it.
        self.token = uuid.uuid4().hex[:12]
        self.writers: list[SinkWriter] = []
        self._output: Any = None
        self._ledger: Any = None
        self.history: list[BatchResult] = []

    def _record_dir(self) -> str:
        return f"{self.pipeline.name}/spark-stream/{self.query}"

    def _record_path(self, epoch: int, token: str) -> str:
        """The pre-commit record of ``epoch`` by the driver of ``token`` (empty: a record of a
        version before tokens, which the ledger names with no metadata)."""
        suffix = f"-{token}" if token else ""
        return f"{self._record_dir()}/{epoch:010d}{suffix}.json"

    def open(self) -> int:
        """Fence earlier drivers, read the ledger, recover the sinks; returns the last
        committed epoch (0: none)."""
        from confluent_kafka import Consumer, TopicPartition

        from snapline.pipeline.checkpoint.storage import CheckpointStorage
        from snapline.pipeline.runtime.transaction import TransactionalOutput
        from snapline.pipeline.savepoint.control import control_topic, ensure_control_topic

        ensure_control_topic(self.kafka_config, self.pipeline.name)
        self._control = TopicPartition(control_topic(self.pipeline.name), 0)
        self._storage = CheckpointStorage(self.checkpoint_dir)
        self._output = TransactionalOutput(
            {**self.kafka_config, "client.id": self.task_id},
            transactional_id=f"snapline-spark-stream-{self.pipeline.name}-{self.query}",
        )
        # init_transactions first: it fences every earlier driver of this query, so the
        # ledger read next is final.
        self._output.init()
        self._ledger = Consumer(
            {
                **self.kafka_config,
                "group.id": self.ledger_group,
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        offset, committer = _committed_offset(self._ledger, self._control)
        if offset < 1:
            # The ledger is a consumer group's offset, which Kafka deletes
            # offsets.retention.minutes (7 days) after its last commit: a query stopped that
            # long would commit again the batches Spark replays. The committed marks say what
            # it had committed.
            marked = self._committed_marks()
            if marked:
                offset, committer = max(marked)
                log.warning(
                    "query %s: the ledger %s holds no offset (expired?); its committed marks "
                    "say epoch %d was committed",
                    self.query,
                    self.ledger_group,
                    offset,
                )
        self.committed = max(offset, 0)
        metadata: dict[str, Any] = {}
        record = self._record_path(self.committed, committer)
        if self.committed:
            if not self._storage.exists(record):
                # Recovering without it would take the epoch's staged output for dead and
                # discard it: output Kafka's ledger says is committed.
                raise SinkError(
                    f"query {self.query}: epoch {self.committed} is committed in Kafka (ledger "
                    f"{self.ledger_group}), but its pre-commit record "
                    f"{self._storage.full_path(record)} is missing, so its Parquet and "
                    "PostgreSQL output cannot be published; was the checkpoint directory "
                    "changed or emptied? Restore it, or start the query on a new checkpoint "
                    "location"
                )
            metadata = decode_checked(
                self._storage.read_bytes(record), self._storage.full_path(record), "sinks"
            )
        self._discard_dead_records()
        self.writers = [
            sink.open(
                SinkContext(
                    job=self.pipeline.name,
                    task_id=self.task_id,
                    worker_id="spark",
                    sink_name=sink.name,
                    output=self._output,
                    dead_letter=self._sink_dead_letter,
                )
            )
            for sink in self.sinks
        ]
        for sink, writer in zip(self.sinks, self.writers, strict=True):
            writer.recover(self.committed or None, metadata.get("sinks", {}).get(sink.name))
        log.info("query %s: last committed epoch %d", self.query, self.committed)
        return self.committed

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        if self._ledger is not None:
            self._ledger.close()
        if self._output is not None:
            self._output.close()

    # ------------------------------------------------------------------ one batch
    def __call__(self, df: Any, batch_id: int) -> None:
        self.commit_batch(df.collect(), batch_id)

    def commit_batch(self, rows: list[Any], batch_id: int) -> BatchResult:
        """Commit the rows (OUT_SCHEMA) of micro-batch ``batch_id`` (see module)."""
        started = time.monotonic()
        epoch = batch_id + 1
        if epoch <= self.committed:
            log.info("batch %d: committed before a restart (epoch %d); skipped", batch_id, epoch)
            result = BatchResult(batch_id, epoch, len(rows), False, time.monotonic() - started)
            self.history.append(result)
            return result
        tuples = sorted((tuple(r) for r in rows), key=output_order)
        self._output.begin(epoch)
        per_sink: dict[int, list[Record]] = {}
        fields = {name: i for i, name in enumerate(OUT_FIELDS)}
        s_i, t_i, p_i = fields["sink"], fields["topic"], fields["partition"]
        o_i, ts_i = fields["offset"], fields["ts"]
        k_i, v_i, rk_i, why_i = (fields[f] for f in ("key", "value", "raw_key", "reason"))
        for row in tuples:
            if row[s_i] < 0:
                self._produce_dead_letter(epoch, row, t_i, p_i, o_i, v_i, rk_i, why_i)
                continue
            key, key_bytes = (None, None) if row[k_i] is None else untag_key(bytes(row[k_i]))
            record = Record(
                pickle.loads(row[v_i]),
                row[ts_i],
                row[t_i],
                row[p_i],
                row[o_i],
                key,
                key_bytes,
                raw_key=None if row[rk_i] is None else bytes(row[rk_i]),
            )
            per_sink.setdefault(row[s_i], []).append(record)
        for index, records in per_sink.items():
            self.writers[index].write_batch(records, epoch)
        sinks: dict[str, Any] = {}
        for sink, writer in zip(self.sinks, self.writers, strict=True):
            pre = writer.pre_commit(epoch)
            if isinstance(pre, Future):
                pre = pre.result(timeout=600)
            if pre:
                sinks[sink.name] = pre
        self._storage.write_bytes(
            self._record_path(epoch, self.token), encode_checked({"sinks": sinks})
        )
        self._output.commit(
            [_tp(self._control.topic, epoch, self.token)],
            self._ledger.consumer_group_metadata(),
        )
        self.committed = epoch
        self._storage.write_bytes(self._mark_path(epoch, self.token), b"")
        _inject_kill(epoch)
        for writer in self.writers:
            writer.commit(epoch)
        if epoch > 2:
            # Two commits later nobody reads it: recovery reads the last committed epoch's.
            self._storage.delete_file(self._record_path(epoch - 2, self.token))
            self._storage.delete_file(self._mark_path(epoch - 2, self.token))
        result = BatchResult(batch_id, epoch, len(tuples), True, time.monotonic() - started)
        self.history.append(result)
        log.info("batch %d: %d rows committed as epoch %d", batch_id, len(tuples), epoch)
        return result

    def _mark_path(self, epoch: int, token: str) -> str:
        """Written once ``epoch``'s Kafka transaction committed: outlives the ledger."""
        return f"{self._record_dir()}/committed-{epoch:010d}-{token}"

    def _committed_marks(self) -> list[tuple[int, str]]:
        """(epoch, token) of every committed mark (each driver's: a fenced one may write the
        mark of an epoch it committed after a newer driver wrote higher ones)."""
        out = []
        for name in self._storage.list_dir(self._record_dir()):
            parts = name.split("-", 2)
            if len(parts) == 3 and parts[0] == "committed" and parts[1].isdigit():
                out.append((int(parts[1]), parts[2]))
        return out

    def _discard_dead_records(self) -> None:
        """Delete the pre-commit records of epochs two or more below the last committed one,
        whoever wrote them. Dead: recovery reads only the committed epoch's record, the ledger
        never goes back, and a driver that starts after this one reads a ledger at least as
        high, so it writes records of higher epochs only; a fenced driver's record of an older
        epoch can never commit."""
        for name in self._storage.list_dir(self._record_dir()):
            epoch = name.split("-", 1)[0].removesuffix(".json")
            if name.endswith(".json") and epoch.isdigit() and int(epoch) <= self.committed - 2:
                self._storage.delete_file(f"{self._record_dir()}/{name}")
        for marked, token in self._committed_marks():
            if marked <= self.committed - 2:
                self._storage.delete_file(self._mark_path(marked, token))

    def _produce_dead_letter(
        self, epoch: int, row: tuple[Any, ...], t: int, p: int, o: int, v: int, rk: int, why: int
    ) -> None:
        if self.pipeline.on_error == "fail":
            raise SinkError(f"dead letter with on_error='fail': {row[why]}")
        headers = dead_letter_headers(str(row[why]), str(row[t]), row[p], row[o], self.task_id)
        value = None if row[v] is None else bytes(row[v])
        key = None if row[rk] is None else bytes(row[rk])
        self._output.produce(epoch, self.pipeline.dead_letter_topic, value, key, headers)

    def _sink_dead_letter(self, record: Record, reason: str, epoch: int) -> None:
        if self.pipeline.on_error == "fail":
            raise SinkError(f"{reason} (pipeline on_error='fail')")
        try:
            value = orjson.dumps(record.value, default=str)
        except TypeError:
            value = repr(record.value).encode()
        headers = dead_letter_headers(
            reason, record.topic, record.partition, record.offset, self.task_id
        )
        # The sink refused the row because it is too large for a Kafka record: a dead letter
        # of the same row would fail every retry of the micro-batch. Keep its first bytes.
        limit = int(getattr(self._output, "max_message_bytes", 1_000_000))
        if record_size(value, record.raw_key, headers) > limit:
            keep = limit // 2
            headers.append(
                ("snapline.value-truncated", f"first {keep} of {len(value)} bytes".encode())
            )
            value = value[:keep]
        self._output.produce(epoch, self.pipeline.dead_letter_topic, value, record.raw_key, headers)


def _inject_kill(epoch: int) -> None:
    """Tests: SIGKILL this driver right after the Kafka commit point of a batch, before the
    other sinks publish and before Spark records the batch as done (the worst moment)."""
    import os
    import signal

    if os.environ.get("SNAPLINE_SPARK_STREAM_KILL_AFTER_COMMIT") == "1":
        log.warning("injected SIGKILL after the Kafka commit of epoch %d", epoch)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _committed_offset(consumer: Any, tp: Any, timeout: float = 60.0) -> tuple[int, str]:
    """The ledger's committed offset and its metadata (the token of the driver that committed
    it), retried while the group coordinator is loading or moving (a fresh broker answers
    NOT_COORDINATOR for a while); raises after ``timeout``."""
    from confluent_kafka import KafkaException

    from snapline.pipeline.runtime.kafka_calls import raise_partition_errors

    deadline = time.monotonic() + timeout
    while True:
        try:
            (committed,) = consumer.committed([tp], timeout=30)
            # An error here is no offset, not "nothing committed": that would commit again.
            raise_partition_errors([committed], "the ledger's committed offset")
            return int(committed.offset), committed.metadata or ""
        except KafkaException as exc:
            if time.monotonic() > deadline or exc.args[0].code() not in _COORDINATOR_ERRORS:
                raise
            log.info("ledger not readable yet (%s); retrying", exc)
            time.sleep(0.5)


def _tp(topic: str, offset: int, token: str) -> Any:
    from confluent_kafka import TopicPartition

    return TopicPartition(topic, 0, offset, metadata=token)
