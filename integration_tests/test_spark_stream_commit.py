"""The Spark runners' commit protocol against a fenced driver or attempt, on a real broker.

``snapline spark stream``: a driver that froze in the middle of a batch and woke after a newer
driver had fenced it and committed the same epoch must not change what the next driver
recovers: its pre-commit record of that epoch may not replace the committing driver's, so the
table holds every committed row once and the next driver opens. ``snapline spark run``: the
same for an older attempt of a Spark task (speculation, a lost executor) against the attempt
that committed and a retry after it.

The drivers are ``BatchCommitter`` objects (what ``foreachBatch`` calls) and the attempts are
``run_stage_task`` calls (what each Spark task runs), with real Kafka transactions, real
checkpoint storage and a real Parquet sink; Spark's scheduling plays no part in this protocol
and is left out.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pyarrow.dataset as ds
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from examples.orders import create_topics, read_committed
from snapline import Pipeline
from snapline.connectors import KafkaSource
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import SinkError
from snapline.pipeline.savepoint.control import ensure_control_topic
from snapline.pipeline.spark.bounded import RunConfig, run_stage_task
from snapline.pipeline.spark.stream_commit import BatchCommitter
from snapline.pipeline.stages import SOURCE_STAGE
from snapline.sinks import KafkaSink, ParquetSink

pytestmark = pytest.mark.integration


def _rows(batch: int) -> list[tuple[Any, ...]]:
    """Three sink rows (OUT_SCHEMA) of micro-batch ``batch``: ids batch * 10 + 0..2."""
    return [
        (0, "orders", 0, batch * 10 + i, 0, 0, 0, None, pickle.dumps({"id": batch * 10 + i}))
        + (None, None, None)
        for i in range(3)
    ]


def _ids(table: Path) -> Counter[int]:
    """The ids in the table's published files (pyarrow skips ``_staging``)."""
    if not table.exists():
        return Counter()
    return Counter(ds.dataset(table, format="parquet").to_table(columns=["id"])["id"].to_pylist())


def _driver(
    bootstrap: str, tmp_path: Path, pipeline: Pipeline, sink: Any, start: bool = True
) -> BatchCommitter:
    """A driver of the query at ``tmp_path/spark-location`` (opened when ``start``)."""
    committer = BatchCommitter(
        pipeline,
        (sink,),
        {"bootstrap.servers": bootstrap},
        str(tmp_path / "checkpoints"),
        str(tmp_path / "spark-location"),
    )
    if start:
        committer.open()
    return committer


@pytest.mark.parametrize("frozen_at", ["before its record", "before staging"])
def test_a_fenced_driver_cannot_replace_the_record_of_a_committed_epoch(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, frozen_at: str
) -> None:
    table = tmp_path / "table"
    pipeline = Pipeline(unique_name)
    sink = ParquetSink(str(table), name="table")

    def driver() -> BatchCommitter:
        return _driver(kafka_bootstrap, tmp_path, pipeline, sink)

    d1 = driver()
    d1.commit_batch(_rows(0), 0)  # epoch 1
    # D1 runs batch 1 (epoch 2) and freezes: before writing its pre-commit record, or before
    # its sink stages anything.
    gate, frozen = threading.Event(), threading.Event()

    def freeze() -> None:
        frozen.set()
        assert gate.wait(60), "the test never woke the frozen driver"

    if frozen_at == "before its record":
        write = d1._storage.write_bytes

        def write_bytes(path: str, data: Any) -> None:
            if "/spark-stream/" in path:
                freeze()
            write(path, data)

        d1._storage.write_bytes = write_bytes  # type: ignore[method-assign]
    else:
        pre_commit = d1.writers[0].pre_commit

        def frozen_pre_commit(epoch: int) -> Any:
            freeze()
            return pre_commit(epoch)

        d1.writers[0].pre_commit = frozen_pre_commit  # type: ignore[method-assign,assignment]
    failures: list[BaseException] = []

    def run_d1() -> None:
        try:
            d1.commit_batch(_rows(1), 1)
        except BaseException as exc:  # the fenced commit
            failures.append(exc)

    thread = threading.Thread(target=run_d1, daemon=True)
    thread.start()
    assert frozen.wait(60), "D1 did not reach its freeze point"

    # D2 starts: init_transactions fences D1; it commits epoch 2 and publishes it.
    d2 = driver()
    assert d2.committed == 1
    d2.commit_batch(_rows(1), 1)
    assert _ids(table) == Counter(range(3)) + Counter(range(10, 13))

    gate.set()  # D1 wakes: it writes its record of epoch 2 and cannot commit
    thread.join(120)
    assert not thread.is_alive()
    assert failures, "the fenced driver committed epoch 2 a second time"
    d1.close()
    # D2 dies before committing epoch 3; D3 recovers epoch 2.
    d3 = driver()
    assert d3.committed == 2
    d3.commit_batch(_rows(2), 2)  # epoch 3
    assert _ids(table) == Counter(range(3)) + Counter(range(10, 13)) + Counter(range(20, 23))
    d2.close()
    d3.close()


def test_a_missing_record_of_the_committed_epoch_stops_the_next_driver(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Without the committed epoch's pre-commit record the sinks cannot tell its staged output
    from dead leftovers: the driver must refuse to start, not discard that output."""
    pipeline = Pipeline(unique_name)
    sink = ParquetSink(str(tmp_path / "table"), name="table")

    def driver() -> BatchCommitter:
        return _driver(kafka_bootstrap, tmp_path, pipeline, sink, start=False)

    d1 = driver()
    d1.open()
    d1.commit_batch(_rows(0), 0)
    d1.close()
    (record,) = (tmp_path / "checkpoints").rglob("0000000001-*.json")
    record.unlink()
    with pytest.raises(SinkError, match="pre-commit record .* is missing"):
        driver().open()


def test_a_query_whose_ledger_expired_does_not_commit_its_batches_again(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """The ledger is a consumer group's offset: Kafka deletes it offsets.retention.minutes (7
    days) after the query's last commit. A query restarted later found no ledger, took
    itself for new, and committed the batches Spark replays a second time. The committed
    marks in checkpoint storage say what was committed."""
    table = tmp_path / "table"
    pipeline = Pipeline(unique_name)
    sink = ParquetSink(str(table), name="table")

    def driver() -> BatchCommitter:
        return _driver(kafka_bootstrap, tmp_path, pipeline, sink)

    d1 = driver()
    for batch in range(4):
        d1.commit_batch(_rows(batch), batch)  # epochs 1-4
    d1.close()
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    group = d1.ledger_group
    admin.delete_consumer_groups([group], request_timeout=30)[group].result(timeout=35)
    d2 = driver()
    assert d2.committed == 4
    d2.commit_batch(_rows(3), 3)  # Spark replays the last batch: skipped
    d2.commit_batch(_rows(4), 4)  # epoch 5
    assert _ids(table) == Counter(i for b in range(5) for i in range(b * 10, b * 10 + 3))
    # Marks two epochs behind are deleted (the earlier driver's at the next start).
    marks = sorted(
        int(p.name.split("-")[1]) for p in (tmp_path / "checkpoints").rglob("committed-*")
    )
    assert marks == [3, 4, 5], marks
    d2.close()


def test_an_output_too_large_for_kafka_is_a_dead_letter_not_a_failed_batch(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A KafkaSink row over the producer's message.max.bytes went to the committer's dead
    letter as the same row, which was too large as well: the error escaped the micro-batch
    and every retry failed the same way. Now the dead letter keeps the row's first half of
    the limit and says so; the batch commits with the other rows."""
    out, dead = f"{unique_name}-out", f"{unique_name}.dead-letter"
    create_topics(kafka_bootstrap, {out: 1, dead: 1})
    pipeline = Pipeline(unique_name)
    committer = BatchCommitter(
        pipeline,
        (KafkaSink(out),),
        {"bootstrap.servers": kafka_bootstrap},
        str(tmp_path / "checkpoints"),
        str(tmp_path / "spark-location"),
    )
    committer.open()
    rows = _rows(0)
    big = {"id": 99, "blob": "x" * 1_200_000}
    rows[1] = rows[1][:8] + (pickle.dumps(big),) + rows[1][9:]
    committer.commit_batch(rows, 0)
    committer.close()
    outputs = read_committed(kafka_bootstrap, out, 2, timeout=30, settle=1)
    assert sorted(o["id"] for o in outputs) == [0, 2]
    letters = read_raw(kafka_bootstrap, dead)
    assert len(letters) == 1
    headers = dict(letters[0].headers())
    assert b"of 1200" in headers["snapline.value-truncated"]
    assert letters[0].value().startswith(b'{"id":99,"blob":"xxx')


def bounded_pipeline() -> Pipeline:
    """The bounded test's job: the input topic's JSON values into a Parquet table."""
    pipeline = Pipeline(os.environ["SNAPLINE_TEST_JOB"])
    source = KafkaSource(os.environ["SNAPLINE_TEST_TOPIC"], value_format="json")
    pipeline.source(source).sink(ParquetSink(os.environ["SNAPLINE_TEST_TABLE"], name="table"))
    return pipeline


def test_a_fenced_spark_task_attempt_cannot_replace_the_committed_attempts_record(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt 1 froze after staging, before writing its pre-commit record; attempt 2 fenced
    it, committed and published; attempt 1 woke, wrote its record and failed to commit; a
    retry (attempt 3: the task failed after its commit point) must publish attempt 2's
    output, once."""
    table = tmp_path / "table"
    monkeypatch.setenv("SNAPLINE_TEST_JOB", unique_name)
    monkeypatch.setenv("SNAPLINE_TEST_TOPIC", f"{unique_name}-in")
    monkeypatch.setenv("SNAPLINE_TEST_TABLE", str(table))
    kafka_config = {"bootstrap.servers": kafka_bootstrap}
    ensure_control_topic(kafka_config, unique_name)
    config = RunConfig(
        spec=f"{__name__}:bounded_pipeline",
        run_id="r1",
        kafka_config=kafka_config,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        savepoint_out=str(tmp_path / "savepoint"),
        savepoint_in=None,
        stage_partitions={SOURCE_STAGE: 1},
    )
    rows = [(f"{unique_name}-in", i, None, orjson.dumps({"id": i}), 0) for i in range(5)]

    def attempt() -> None:
        for _ in run_stage_task(config, SOURCE_STAGE, 0, rows):
            pass

    gate, frozen = threading.Event(), threading.Event()
    write = CheckpointStorage.write_bytes

    def write_bytes(self: CheckpointStorage, path: str, data: Any) -> None:
        if threading.current_thread().name == "attempt-1" and f"/spark/{config.run_id}/" in path:
            frozen.set()
            assert gate.wait(60), "the test never woke attempt 1"
        write(self, path, data)

    monkeypatch.setattr(CheckpointStorage, "write_bytes", write_bytes)
    failures: list[BaseException] = []

    def first() -> None:
        try:
            attempt()
        except BaseException as exc:  # the fenced commit
            failures.append(exc)

    thread = threading.Thread(target=first, name="attempt-1", daemon=True)
    thread.start()
    assert frozen.wait(120), "attempt 1 did not reach its pre-commit record"
    attempt()  # attempt 2: fences attempt 1, commits, publishes
    assert _ids(table) == Counter(range(5))
    gate.set()
    thread.join(120)
    assert not thread.is_alive()
    assert failures, "the fenced attempt committed"
    attempt()  # attempt 3 finds the ledger committed and publishes what the committer staged
    assert _ids(table) == Counter(range(5))


def read_raw(bootstrap: str, topic: str) -> list[Any]:
    """Every committed message of ``topic`` (one partition), until 2 s without one."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "raw", "isolation.level": "read_committed"}
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    found: list[Any] = []
    try:
        quiet = 0
        while quiet < 4:
            batch = [m for m in consumer.consume(100, 0.5) if m.error() is None]
            quiet = 0 if batch else quiet + 1
            found += batch
    finally:
        consumer.close()
    return found
