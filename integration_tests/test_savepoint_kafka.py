"""Savepoints against a real broker, without workers: the records in flight are read to the
end of each repartition partition even behind a transaction left open, and a restore that is
refused changes nothing in Kafka."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaException,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from integration_tests.conftest import create_topic
from snapline import ConfigurationError, KafkaSink, KafkaSource, Pipeline
from snapline.pipeline.checkpoint.metadata import CheckpointRef
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError
from snapline.pipeline.runtime.kafka_calls import delete_records
from snapline.pipeline.runtime.topics import TopicManager, pipeline_topics
from snapline.pipeline.savepoint import export
from snapline.pipeline.savepoint.format import (
    IN_FLIGHT_SCHEMA,
    METADATA_FILE,
    InFlight,
    SavepointFile,
    SavepointMetadata,
    write_table,
)
from snapline.pipeline.savepoint.restore import seed_from_savepoint

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parent.parent


def test_records_in_flight_behind_an_open_transaction_are_waited_for_not_skipped(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed in its epoch leaves its transaction open; records other tasks commit
    behind it are invisible to read_committed readers until it is aborted. The reader used the
    end a read_committed consumer is told (the last stable offset) and an idle poll as its
    stop, so `savepoint create`/`from-checkpoint` wrote a savepoint without them, no error:
    0 of 5 records in the audit's repro."""
    topic = create_topic(admin, f"{unique_name}.rep")
    config = {"bootstrap.servers": kafka_bootstrap}
    zombie = Producer({**config, "transactional.id": f"{unique_name}-zombie"})
    zombie.init_transactions(30)
    zombie.begin_transaction()
    zombie.produce(topic, b"{}", b"szombie", partition=0)
    zombie.flush(10)
    live = Producer({**config, "transactional.id": f"{unique_name}-live"})
    live.init_transactions(30)
    live.begin_transaction()
    for i in range(5):
        live.produce(topic, b"{}", b"sk%d" % i, partition=0)
    live.commit_transaction(30)
    # Never aborted within the limit: an error naming the partition, not a short savepoint.
    monkeypatch.setattr(export, "IN_FLIGHT_TIMEOUT", 3.0)
    with pytest.raises(CheckpointError, match=r"partitions not finished: \{0: 'at 0 of \d+'\}"):
        export.read_in_flight(config, topic, {0: 0})
    # Aborted while the reader waits: every committed record is read, the aborted one not.
    monkeypatch.setattr(export, "IN_FLIGHT_TIMEOUT", 60.0)
    abort = threading.Timer(2.0, lambda: zombie.abort_transaction(30))
    abort.start()
    try:
        table = export.read_in_flight(config, topic, {0: 0})
    finally:
        abort.join(35)
    assert sorted(table.column("key").to_pylist()) == [b"sk%d" % i for i in range(5)]


def _count(bootstrap: str, topic: str, isolation: str = "read_committed") -> int:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "count", "isolation.level": isolation}
    )
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)
        return int(high - low)
    finally:
        consumer.close()


def _records(bootstrap: str, topic: str, expected: int) -> int:
    """The committed records in partition 0 of ``topic``, read (offsets count the commit
    markers of transactions too): until ``expected`` were read and 2 s more brought none
    (the restore's transaction makes its records visible together, once its commit markers
    are written, a moment after it returned), 30 s at most."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "count", "isolation.level": "read_committed"}
    )
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        read = 0
        deadline = time.monotonic() + 30
        quiet_until = deadline
        while time.monotonic() < min(deadline, quiet_until):
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                read += 1
                if read >= expected:
                    quiet_until = time.monotonic() + 2.0
        return read
    finally:
        consumer.close()


def _keys_read(consumer: Consumer, committed: list[TopicPartition], count: int) -> list[bytes]:
    """The keys of up to ``count`` records read from ``committed`` (the positions a restore
    committed), for 30 s at most (the restore flushed them: they are there at once); closes
    ``consumer``."""
    keys: list[bytes] = []
    try:
        consumer.assign(committed)
        deadline = time.monotonic() + 30
        while len(keys) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                keys.append(msg.key())
    finally:
        consumer.close()
    return keys


def _savepoint_of_counts_job(
    path: Path,
    job: str,
    source: str,
    rows: int,
    key_by: str = "by-k",
    table: pa.Table | None = None,
) -> SavepointFile:
    """A savepoint of ``_counts_job(..., key_by)`` at source offset 0 with ``rows`` records in
    flight, or those of ``table``; returns their file's entry. The default file has the
    columns of savepoints before headers were kept (no ``headers``): restores read those too."""
    storage = CheckpointStorage(str(path))
    if table is None:
        table = pa.table(
            {
                "partition": [0] * rows,
                "offset": list(range(rows)),
                "key": [b"sk%d" % i for i in range(rows)],
                "value": [b"{}"] * rows,
                "timestamp": [1] * rows,
            },
            schema=pa.schema([f for f in IN_FLIGHT_SCHEMA if f.name != "headers"]),
        )
    entry = write_table(storage, f"in-flight/{key_by}.parquet", table)
    flight = InFlight(key_by, f"{job}.{key_by}.repartition", 1, [entry])
    meta = SavepointMetadata(job, "0.1.0", 128, {source: {0: 0}}, {source: 1}, [], [flight])
    storage.write_bytes(METADATA_FILE, meta.encode())
    return entry


def _counts_job(admin: AdminClient, job: str, key_by: str) -> tuple[Pipeline, str]:
    """A count per key after a re-keying ``key_by(name=key_by)``, and its source topic."""
    pipeline = Pipeline(job)
    source = create_topic(admin, f"{job}-in")
    create_topic(admin, f"{job}-out")
    (
        pipeline.source(KafkaSource(source, value_format="json"))
        .key_by(lambda v: v["k"], name=key_by)
        .count(uid="counts")
        .sink(KafkaSink(f"{job}-out"))
    )
    return pipeline, source


def test_a_refused_restore_leaves_the_repartition_topics_as_they_were(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str, tmp_path: Path
) -> None:
    """The restore deleted and recreated the job's repartition topics, then found the savepoint
    unusable (records in flight in a repartition the code renamed; a corrupt file): the job's
    committed checkpoints read from those topics, so a plain restart lost what was in flight.
    Now every check comes first. An empty repartition that the code renamed is nothing to
    place and no longer refused."""
    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source = _counts_job(admin, job, "renamed")
    repartition = create_topic(admin, f"{job}.renamed.repartition")
    producer = Producer(config)
    for i in range(20):
        producer.produce(repartition, b"{}", b"sk%d" % i, partition=0)
    producer.flush(10)
    assert _count(kafka_bootstrap, repartition) == 20

    def savepoint(rows: int) -> str:
        path = tmp_path / f"sp-{rows}"
        _savepoint_of_counts_job(path, job, source, rows, key_by="key_by-1")
        return str(path)

    checkpoints = str(tmp_path / "checkpoints")
    with pytest.raises(ConfigurationError, match="records in flight in repartition 'key_by-1'"):
        seed_from_savepoint(pipeline, config, checkpoints, savepoint(1))
    assert _count(kafka_bootstrap, repartition) == 20, "the refused restore emptied the topic"
    restored = seed_from_savepoint(pipeline, config, checkpoints, savepoint(0))
    assert restored is not None
    assert _count(kafka_bootstrap, repartition) == 0  # emptied for the restored job


def test_a_restore_needs_nothing_of_the_savepoint_storage_once_kafka_is_changed(
    kafka_bootstrap: str,
    admin: AdminClient,
    unique_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The files of records in flight were checksummed before Kafka was changed but read from
    the savepoint's storage again after the repartition topics were emptied: a
    storage error then (an object store's hiccup, a file removed meanwhile) stopped the
    restore halfway, and a restart from the job's own checkpoints found nothing of what had
    been in flight. They are now copied to local disk with the check, and produced from there."""
    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source = _counts_job(admin, job, "by-k")
    repartition = f"{job}.by-k.repartition"
    path = tmp_path / "sp"
    rows = 5
    entry = _savepoint_of_counts_job(path, job, source, rows)

    from snapline.pipeline.savepoint import restore

    empty = restore._empty_repartition_topic

    def empty_then_lose_the_savepoint(*args: object, **kwargs: object) -> dict[int, int]:
        starts = empty(*args, **kwargs)  # type: ignore[arg-type]
        (path / entry.path).unlink(missing_ok=True)  # the savepoint's storage fails from here
        return starts

    monkeypatch.setattr(restore, "_empty_repartition_topic", empty_then_lose_the_savepoint)
    restored = seed_from_savepoint(pipeline, config, str(tmp_path / "checkpoints"), str(path))
    assert restored is not None
    assert not (path / entry.path).exists()
    restored_records = _records(kafka_bootstrap, repartition, rows)
    assert restored_records == rows, "records in flight were not restored"


def test_an_at_least_once_restore_writes_back_without_a_transaction(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str, tmp_path: Path
) -> None:
    """An at-least-once job uses no Kafka transactions (its cluster may offer none), so its
    restore writes the records in flight back and commits the job's offsets without one:
    no commit marker follows the records, and the offsets name the seeded checkpoint."""
    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source = _counts_job(admin, job, "by-k")
    pipeline.guarantee = "at_least_once"
    rows = 5
    _savepoint_of_counts_job(tmp_path / "sp", job, source, rows)
    checkpoint = seed_from_savepoint(
        pipeline, config, str(tmp_path / "checkpoints"), str(tmp_path / "sp")
    )
    assert checkpoint is not None
    repartition = f"{job}.by-k.repartition"
    assert _count(kafka_bootstrap, repartition, "read_uncommitted") == rows, "a marker"
    assert _records(kafka_bootstrap, repartition, rows) == rows
    consumer = Consumer({**config, "group.id": job})
    try:
        [offset] = consumer.committed([TopicPartition(source, 0)], timeout=10)
    finally:
        consumer.close()
    assert offset.offset == 0
    ref = CheckpointRef.parse_offset_metadata(offset.metadata)
    assert ref is not None and ref.checkpoint_id == checkpoint


def _wait_for_cleanup_policy(admin: AdminClient, topic: str, policy: str) -> None:
    """Until ``topic``'s cleanup.policy reads ``policy``, 30 s at most (the brokers apply a
    change from the metadata log, a moment after the call returned)."""
    deadline = time.monotonic() + 30
    while True:
        [future] = admin.describe_configs([ConfigResource("topic", topic)]).values()
        now = future.result(timeout=30)["cleanup.policy"].value
        if now == policy:
            return
        assert time.monotonic() < deadline, f"{topic}: cleanup.policy={now}, not {policy}"
        time.sleep(0.2)


def test_a_compacted_repartition_topic_is_kept_with_delete_and_restored(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str, tmp_path: Path
) -> None:
    """A repartition topic created with cleanup.policy=compact (by hand, or a broker's
    default) refused the DeleteRecords that empty it: the restore failed after its first
    change, and a running job's compaction dropped every record of a key but its newest
    before the next stage read it. The restore sets delete before any change (as a worker
    does at its start: TopicManager.accept_any_event_time) and then restores."""
    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source = _counts_job(admin, job, "by-k")
    repartition = create_topic(
        admin, f"{job}.by-k.repartition", config={"cleanup.policy": "compact"}
    )
    producer = Producer(config)
    for i in range(20):
        producer.produce(repartition, b"{}", b"sk%d" % (i % 3), partition=0)
    producer.flush(10)
    rows = 5
    _savepoint_of_counts_job(tmp_path / "sp", job, source, rows)
    restored = seed_from_savepoint(
        pipeline, config, str(tmp_path / "checkpoints"), str(tmp_path / "sp")
    )
    assert restored is not None
    _wait_for_cleanup_policy(admin, repartition, "delete")
    assert _records(kafka_bootstrap, repartition, rows) == rows  # the 20 deleted
    # A worker at its start sets it too (the topic compacted again by hand meanwhile).
    admin.incremental_alter_configs(
        [
            ConfigResource(
                "topic",
                repartition,
                incremental_configs=[
                    ConfigEntry(
                        "cleanup.policy", "compact", incremental_operation=AlterConfigOpType.SET
                    )
                ],
            )
        ]
    )[ConfigResource("topic", repartition)].result(timeout=30)
    _wait_for_cleanup_policy(admin, repartition, "compact")
    TopicManager(config, kafka_bootstrap).accept_any_event_time(pipeline_topics(pipeline))
    _wait_for_cleanup_policy(admin, repartition, "delete")


def test_records_in_flight_keep_their_headers_through_a_savepoint(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str, tmp_path: Path
) -> None:
    """A record's headers cross a re-keying key_by's repartition topic with it, so a later
    stage's dead letter carries the input's trace id; records in flight when a savepoint was
    taken were saved and written back without them. Each record must come back with its own
    headers, in order, a repeated name and a null value included, and one without headers
    without any. One its headers take over the restore's message.max.bytes (1 MB) comes
    back without them, as the repartition writer sends such a record, not as an error."""
    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source = _counts_job(admin, job, "by-k")
    repartition = create_topic(
        admin, f"{job}.by-k.repartition", config={"max.message.bytes": "2000000"}
    )
    big = b"x" * 600_000
    sent: dict[bytes, list[tuple[str, bytes | None]]] = {
        b"sk0": [("trace-id", b"t-0"), ("tag", b"a"), ("tag", None)],
        b"sk1": [],
        b"sk2": [("trace-id", b"t-2")],
        b"sk3": [("big", big)],
    }
    producer = Producer({**config, "message.max.bytes": 2_000_000})
    for key, headers in sent.items():
        value = big if key == b"sk3" else b"{}"
        producer.produce(repartition, value, key, partition=0, headers=headers or None)
    producer.flush(10)
    table = export.read_in_flight(config, repartition, {0: 0})
    path = tmp_path / "sp"
    _savepoint_of_counts_job(path, job, source, table.num_rows, table=table)
    restored = seed_from_savepoint(pipeline, config, str(tmp_path / "checkpoints"), str(path))
    assert restored is not None
    consumer = Consumer({**config, "group.id": f"{job}-check", "auto.offset.reset": "earliest"})
    got: dict[bytes, list[tuple[str, bytes | None]]] = {}
    try:
        consumer.assign([TopicPartition(repartition, 0, 0)])
        deadline = time.monotonic() + 30  # the restore flushed them: they are there
        while len(got) < len(sent) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                assert msg.key() not in got, f"{msg.key()!r} restored twice"
                got[msg.key()] = list(msg.headers() or [])
    finally:
        consumer.close()
    assert got == {**sent, b"sk3": []}
    assert _records(kafka_bootstrap, repartition, len(sent)) == len(sent), "not emptied"


def test_a_zombies_delete_by_its_old_positions_after_a_restore_deletes_nothing_restored(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str, tmp_path: Path
) -> None:
    """Found by the audit of destructive actions: a worker frozen past its session between its
    topic id check and its DeleteRecords call (which addresses a topic by name) woke after a
    restore had deleted and created the repartition topic again, with offsets from 0, and
    deleted the records in flight the restore had written there, below its old position.
    Now the restore empties the topic and its offsets go on: every old position lies below
    the restored records. Here the code also declares 2 partitions where the topic had 1
    (a rescale): the partition added starts at 0, where no old position points. Every record
    in flight must be read from the positions the restore committed."""
    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline = Pipeline(job)
    source = create_topic(admin, f"{job}-in")
    create_topic(admin, f"{job}-out")
    (
        pipeline.source(KafkaSource(source, value_format="json"))
        .key_by(lambda v: v["k"], name="by-k", partitions=2)
        .count(uid="counts")
        .sink(KafkaSink(f"{job}-out"))
    )
    repartition = create_topic(admin, f"{job}.by-k.repartition")
    producer = Producer(config)
    for i in range(50):  # what the job before the restore wrote
        producer.produce(repartition, b"{}", b"sold%d" % i, partition=0)
    producer.flush(10)
    rows = 12
    _savepoint_of_counts_job(tmp_path / "sp", job, source, rows, key_by="by-k")
    restored = seed_from_savepoint(
        pipeline, config, str(tmp_path / "checkpoints"), str(tmp_path / "sp")
    )
    assert restored is not None
    # The zombie wakes: it had read 10 records of partition 0 and deletes below that.
    for future in delete_records(
        admin, [TopicPartition(repartition, 0, 10)], request_timeout=30
    ).values():
        future.result(timeout=35)
    consumer = Consumer(
        {**config, "group.id": job, "enable.auto.commit": False, "auto.offset.reset": "error"}
    )
    committed = consumer.committed([TopicPartition(repartition, p) for p in range(2)], timeout=30)
    keys = _keys_read(consumer, committed, rows)
    assert sorted(keys) == sorted(b"sk%d" % i for i in range(rows)), "records in flight lost"
    # Where the restored tasks start: past every old record in partition 0, at 0 in the new one.
    assert [tp.offset for tp in committed] == [50, 0]


def _job_waiting_2s_for_transactions(admin: AdminClient, job: str) -> tuple[Pipeline, str, str]:
    """``_counts_job(..., "by-k")`` whose transaction.timeout.ms is 2 s (a restore waits that
    long for an open transaction, with OPEN_TRANSACTION_GRACE patched to 0), its source topic,
    and its repartition topic (created)."""
    pipeline, source = _counts_job(admin, job, "by-k")
    pipeline.kafka_config["transaction.timeout.ms"] = 2000
    return pipeline, source, create_topic(admin, f"{job}.by-k.repartition")


def _worker_in_a_transaction(
    config: dict[str, Any], checkpoints: str, job: str, topic: str, records: int
) -> Producer:
    """Worker w7 of ``job`` as a crash or a running epoch leaves it: its producer (the
    worker's transactional id, a 10-minute transaction timeout) in a transaction holding
    ``records`` records of ``topic``, and the entry of its last restore in the job's history
    (the restore's list of the job's workers)."""
    from snapline.pipeline.checkpoint.history import HistoryEntry, HistoryWriter
    from snapline.pipeline.runtime.departed import transactional_id

    producer = Producer(
        {
            **config,
            "transactional.id": transactional_id(job, "w7"),
            "transaction.timeout.ms": 600_000,
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(records):
        producer.produce(topic, b"{}", b"sold%d" % i, partition=0)
    assert producer.flush(10) == 0
    history = HistoryWriter(checkpoints, job, "w7")
    history.record(HistoryEntry(kind="restore", worker="w7", status="restored", time=time.time()))
    assert history.close() == []
    return producer


def _restored_start_and_keys(
    config: dict[str, Any], job: str, topic: str, rows: int
) -> tuple[list[int], list[bytes]]:
    """Where the restore committed the job's group in ``topic`` (partition 0), and the keys of
    up to ``rows`` records read committed from there."""
    reader = Consumer(
        {
            **config,
            "group.id": job,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    committed = reader.committed([TopicPartition(topic, 0)], timeout=30)
    return [tp.offset for tp in committed], _keys_read(reader, committed, rows)


def test_a_restore_waits_for_a_transaction_left_open_in_a_repartition_topic(
    kafka_bootstrap: str,
    admin: AdminClient,
    unique_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the restore keeps each repartition topic and empties it, but a
    transaction a killed worker left open there survives the emptying, and the restored
    stage's read_committed tasks read nothing past it, the records in flight included, until
    Kafka aborts it (transaction.timeout.ms, which may be minutes). The restore now waits for
    it before changing anything: past the job's transaction.timeout.ms (here 2 s, no grace)
    it refuses and the topic is as it was; aborted meanwhile, the restore goes on and every
    record in flight is read committed from where the restore committed."""
    from snapline.pipeline.savepoint import restore

    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source, repartition = _job_waiting_2s_for_transactions(admin, job)
    zombie = Producer({**config, "transactional.id": f"{job}-killed-worker"})
    zombie.init_transactions(30)
    zombie.begin_transaction()
    for i in range(3):
        zombie.produce(repartition, b"{}", b"sold%d" % i, partition=0)
    assert zombie.flush(10) == 0
    rows = 5
    _savepoint_of_counts_job(tmp_path / "sp", job, source, rows)
    checkpoints = str(tmp_path / "checkpoints")
    monkeypatch.setattr(restore, "OPEN_TRANSACTION_GRACE", 0.0)
    with pytest.raises(CheckpointError, match=r"a transaction is still open .*\[0\] at 0 of 3"):
        seed_from_savepoint(pipeline, config, checkpoints, str(tmp_path / "sp"))
    written = _count(kafka_bootstrap, repartition, "read_uncommitted")
    assert written == 3, "the refused restore changed the topic"

    pipeline.kafka_config["transaction.timeout.ms"] = 60000
    abort = threading.Timer(2.0, lambda: zombie.abort_transaction(30))
    abort.start()
    try:
        assert seed_from_savepoint(pipeline, config, checkpoints, str(tmp_path / "sp"))
    finally:
        abort.join(35)
    start, keys = _restored_start_and_keys(config, job, repartition, rows)
    # Emptied after the abort: past its 3 records and its abort marker.
    assert start == [4], "the restore did not wait for the abort"
    assert sorted(keys) == sorted(b"sk%d" % i for i in range(rows))


def test_a_restore_aborts_the_open_transaction_of_a_worker_in_the_jobs_history(
    kafka_bootstrap: str,
    admin: AdminClient,
    unique_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A restore right after a crash waited for the killed workers' open transactions until
    Kafka aborted them, transaction.timeout.ms after they began (a minute by default). The
    job's group has no member then, so each worker its checkpoint history names is dead or a
    zombie: the restore aborts their transactions with their transactional ids, as their
    restarts would, and fences a zombie. Here the killed worker's transaction would stay open
    for 10 minutes while the restore waits 2 s at most: it succeeds only by that abort, and
    the worker's producer is fenced."""
    from snapline.pipeline.savepoint import restore

    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source, repartition = _job_waiting_2s_for_transactions(admin, job)
    checkpoints = str(tmp_path / "checkpoints")
    killed = _worker_in_a_transaction(config, checkpoints, job, repartition, 3)
    rows = 5
    _savepoint_of_counts_job(tmp_path / "sp", job, source, rows)
    monkeypatch.setattr(restore, "OPEN_TRANSACTION_GRACE", 0.0)
    assert seed_from_savepoint(pipeline, config, checkpoints, str(tmp_path / "sp"))
    with pytest.raises(KafkaException, match="(?i)fenced|epoch"):
        killed.commit_transaction(30)
    start, keys = _restored_start_and_keys(config, job, repartition, rows)
    assert start == [4], "emptied before the abort marker"
    assert sorted(keys) == sorted(b"sk%d" % i for i in range(rows))


def test_a_restore_fences_no_worker_while_the_job_runs(
    kafka_bootstrap: str,
    admin: AdminClient,
    unique_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the restore aborted the history's workers' transactions before its
    guard's check. A restore frozen after its last members check and woken once another
    restore had finished (or a worker started meanwhile) fenced the running job's workers,
    each then replaced its producer and replayed its epoch. Now the guard comes first: with a
    member in the job's group the restore stops, and the worker's transaction still commits."""
    from snapline.pipeline.savepoint import restore

    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source, repartition = _job_waiting_2s_for_transactions(admin, job)
    checkpoints = str(tmp_path / "checkpoints")
    running = _worker_in_a_transaction(config, checkpoints, job, repartition, 1)
    _savepoint_of_counts_job(tmp_path / "sp", job, source, 5)
    monkeypatch.setattr(restore, "OPEN_TRANSACTION_GRACE", 0.0)
    # The job starts after the restore's last members check (as after a freeze there), and
    # after the check before its fence of earlier restores (which would stop it first).
    monkeypatch.setattr(restore, "wait_until_stopped", lambda admin, job: 0)
    producer_of = restore._restore_producer

    class Unasked:
        def check(self, *args: object, **kwargs: object) -> None:
            pass

    monkeypatch.setattr(
        restore,
        "_restore_producer",
        lambda config, pipeline, admin, guard: producer_of(
            config,
            pipeline,
            admin,
            Unasked(),  # type: ignore[arg-type]
        ),
    )
    member = Consumer({**config, "group.id": job, "enable.auto.commit": False})
    member.subscribe([source])
    deadline = time.monotonic() + 60  # a group join takes a few seconds
    while not member.assignment():
        assert time.monotonic() < deadline, "the member was never assigned"
        member.poll(0.2)
    try:
        with pytest.raises(CheckpointError, match="was about to abort .* the job runs"):
            seed_from_savepoint(pipeline, config, checkpoints, str(tmp_path / "sp"))
    finally:
        member.close()
    running.commit_transaction(30)  # not fenced: it raised "fenced" when the abort came first


def test_records_in_flight_that_kafka_deleted_are_an_error_not_skipped(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str
) -> None:
    """Found by review: a worker that went on during `savepoint create` (resumed after the
    pause limit, or started meanwhile) deletes the repartition records it no longer needs,
    past the savepoint's positions. The reader jumped to the log's new start (auto.offset.reset
    earliest, errors skipped): 40 of the 80 records from offset 20 in the review's repro, no
    error."""
    topic = create_topic(admin, f"{unique_name}.rep")
    config = {"bootstrap.servers": kafka_bootstrap}
    producer = Producer(config)
    for i in range(100):
        producer.produce(topic, b"{}", b"sk%d" % i, partition=0)
    producer.flush(10)
    deleted = delete_records(admin, [TopicPartition(topic, 0, 60)], request_timeout=30)
    for future in deleted.values():
        future.result(timeout=35)
    with pytest.raises(CheckpointError, match=r"partition 0: from 20, the log now starts at 60"):
        export.read_in_flight(config, topic, {0: 20})
    assert export.read_in_flight(config, topic, {0: 60}).num_rows == 40


def test_a_savepoint_of_a_job_that_commits_meanwhile_is_refused(
    kafka_bootstrap: str,
    admin: AdminClient,
    unique_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: the records in flight are read to the topics' ends at the time of
    reading. A worker that commits while the state is exported (resumed after the pause limit,
    or started meanwhile) adds records whose sources the savepoint reads again: after a
    restore they were counted twice. The job's committed offsets are read again after the
    records in flight; here a commit to the job's group lands while they are read."""
    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source = _counts_job(admin, job, "by-k")
    create_topic(admin, f"{job}.by-k.repartition")
    read = export.read_in_flight

    def read_while_the_job_commits(*args: object, **kwargs: object) -> pa.Table:
        worker = Consumer({**config, "group.id": job, "enable.auto.commit": False})
        try:
            worker.commit(offsets=[TopicPartition(source, 0, 7)], asynchronous=False)
        finally:
            worker.close()
        return read(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(export, "read_in_flight", read_while_the_job_commits)
    target = tmp_path / "sp"
    with pytest.raises(CheckpointError, match=rf"committed new checkpoints .*{source}\[0\]"):
        export.export_savepoint(
            pipeline, config, str(tmp_path / "checkpoints"), str(target), origin="test"
        )
    assert not (target / METADATA_FILE).exists()


def test_a_restore_that_died_after_changing_kafka_keeps_workers_out_until_it_is_finished(
    kafka_bootstrap: str,
    admin: AdminClient,
    unique_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a restore that died after recreating the repartition topics and
    before resetting the group's offsets left them naming the old checkpoints, whose positions
    in the recreated topics mean nothing; a worker started without --from-savepoint went on
    from them (records skipped or read twice, silently). Now a worker refuses to start (exit
    78, naming the savepoint) until a restore completes; a savepoint of it is refused too, and
    a restore of the savepoint the job was restored from before finishes it (the marker of
    that earlier restore made it return "already restored": found by a review of the fix)."""
    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline, source = _counts_job(admin, job, "by-k")
    earlier, path = tmp_path / "sp-earlier", tmp_path / "sp"
    _savepoint_of_counts_job(earlier, job, source, 0)
    _savepoint_of_counts_job(path, job, source, 0)
    checkpoints = tmp_path / "checkpoints"
    assert seed_from_savepoint(pipeline, config, str(checkpoints), str(earlier)) is not None

    from snapline.pipeline.savepoint import restore

    empty = restore._empty_repartition_topic

    def empty_then_die(*args: object, **kwargs: object) -> None:
        empty(*args, **kwargs)  # type: ignore[arg-type]
        raise SystemExit("killed after the first change to Kafka")

    with monkeypatch.context() as patch:
        patch.setattr(restore, "_empty_repartition_topic", empty_then_die)
        with pytest.raises(SystemExit):
            seed_from_savepoint(pipeline, config, str(checkpoints), str(path))

    spec = tmp_path / "countsjob.py"
    spec.write_text(
        "from snapline import KafkaSink, KafkaSource, Pipeline\n"
        f"pipeline = Pipeline({job!r})\n"
        f"pipeline.source(KafkaSource({source!r}, value_format='json')).key_by(\n"
        "    lambda v: v['k'], name='by-k'\n"
        f").count(uid='counts').sink(KafkaSink({job + '-out'!r}))\n"
    )
    run = [sys.executable, "-m", "snapline.pipeline.cli", "run", "countsjob:pipeline"]
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}",
        "SNAPLINE_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SNAPLINE_CHECKPOINT_DIR": str(checkpoints),
    }
    refused = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 78, refused.stderr[-3000:]
    assert "stopped after it had changed Kafka" in refused.stderr
    assert f"--from-savepoint {path}" in refused.stderr

    with pytest.raises(ConfigurationError, match="stopped after it had changed Kafka"):
        export.export_savepoint(
            pipeline, config, str(checkpoints), str(tmp_path / "sp-of-it"), origin="test"
        )

    # A restore (here of the earlier savepoint) completes; then workers may start.
    assert seed_from_savepoint(pipeline, config, str(checkpoints), str(earlier)) is not None
    assert not (checkpoints / job / restore.RESTORING).exists()
    restore.check_no_interrupted_restore(CheckpointStorage(str(checkpoints)), job)


def test_a_restore_creates_a_repartition_topic_with_no_more_partitions_than_key_groups(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str, tmp_path: Path
) -> None:
    """Workers create a repartition topic with the sources' partition count, at most
    max_parallelism (one partition per key-group at least); a restore created it with the
    sources' count, more partitions than key-groups, which no task layout can load."""
    job = unique_name
    config = {"bootstrap.servers": kafka_bootstrap}
    pipeline = Pipeline(job, max_parallelism=4)
    source = create_topic(admin, f"{job}-in", partitions=8)
    create_topic(admin, f"{job}-out")
    (
        pipeline.source(KafkaSource(source, value_format="json"))
        .key_by(lambda v: v["k"], name="by-k")
        .count(uid="counts")
        .sink(KafkaSink(f"{job}-out"))
    )
    path = tmp_path / "sp"
    storage = CheckpointStorage(str(path))
    meta = SavepointMetadata(
        job, "0.1.0", 4, {source: dict.fromkeys(range(8), 0)}, {source: 8}, [], []
    )
    storage.write_bytes(METADATA_FILE, meta.encode())
    assert seed_from_savepoint(pipeline, config, str(tmp_path / "checkpoints"), str(path))
    described = admin.describe_topics(
        TopicCollection([f"{job}.by-k.repartition"]), request_timeout=30
    )
    (future,) = described.values()
    assert len(future.result(timeout=30).partitions) == 4


def test_a_repartition_topic_created_after_the_restore_listed_it_is_kept_not_deleted(
    kafka_bootstrap: str, admin: AdminClient, unique_name: str
) -> None:
    """Found in review of the destructive actions: when the restore's listing did not show a
    repartition topic, it "recreated" it: deleted it if a second listing showed it, then
    created it. A topic that appeared between the two (created by anyone: a worker's start, a
    broker that auto-creates topics) was deleted and created again under its name, with
    offsets from 0 again. Now the restore only creates; a topic that exists by then is kept
    (same topic id) and emptied up to its ends, like any kept topic."""
    from snapline.pipeline.runtime.topics import describe_topic_ids
    from snapline.pipeline.savepoint import restore

    config = {"bootstrap.servers": kafka_bootstrap}
    topic = create_topic(admin, f"{unique_name}.by-k.repartition", partitions=2)
    producer = Producer(config)
    for i in range(20):
        producer.produce(topic, b"{}", b"r%d" % i, partition=i % 2)
    producer.flush(10)
    before = describe_topic_ids(admin, [topic], "test")[topic]

    class StaleListing:
        """The real admin client, whose first listing is from before the topic existed."""

        def __init__(self) -> None:
            self.listings = 0

        def list_topics(self, *args: Any, **kwargs: Any) -> Any:
            metadata = admin.list_topics(*args, **kwargs)
            self.listings += 1
            if self.listings == 1:
                metadata.topics.pop(topic, None)
            return metadata

        def __getattr__(self, name: str) -> Any:
            return getattr(admin, name)

    steps: list[str] = []
    stale: Any = StaleListing()
    starts = restore._empty_repartition_topic(stale, topic, 2, {}, steps.append)
    assert describe_topic_ids(admin, [topic], "test")[topic] == before, "deleted and created"
    assert starts == {0: 10, 1: 10}, "not emptied up to its ends"
    assert steps[0] == f"was about to create {topic}"
    consumer = Consumer({**config, "group.id": f"{unique_name}-check"})
    try:
        for p in range(2):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
            assert (low, high) == (10, 10)
    finally:
        consumer.close()
