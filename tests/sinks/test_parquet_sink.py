"""ParquetSink through the sink contract on a temporary directory, verified with pyarrow."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from datetime import date
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from snapline.pipeline.errors import (
    ConfigurationError,
    SinkError,
    SinkUnavailableError,
    error_chain,
)
from snapline.pipeline.record import Record
from snapline.pipeline.runtime.worker import unavailable_sink
from snapline.pipeline.sink import SinkContext
from snapline.sinks import parquet as parquet_module
from snapline.sinks.parquet import (
    ParquetSink,
    ParquetSinkWriter,
    hive_partition_dir,
    infer_schema,
    read_commit_log,
)

DeadLetters = list[tuple[Any, str, int]]


def make_writer(
    sink: ParquetSink, task: str = "orders-0", job: str = "orders"
) -> tuple[ParquetSinkWriter, DeadLetters]:
    dead: DeadLetters = []
    context = SinkContext(
        job,
        task,
        "worker-1",
        sink.name,
        None,  # type: ignore[arg-type]
        lambda r, reason, epoch: dead.append((r.value, reason, epoch)),
    )
    return sink.open(context), dead


def records(rows: list[Any], start: int = 0) -> list[Record]:
    return [Record(row, 0, "orders", 0, start + i) for i, row in enumerate(rows)]


def rows_for(checkpoint: int, count: int = 5, day: str = "2024-01-01") -> list[dict[str, Any]]:
    return [
        {
            "id": f"{checkpoint}-{i}",
            "customer": f"c{i % 3}",
            "amount": float(i),
            "day": day,
            "chk": checkpoint,
        }
        for i in range(count)
    ]


def metadata(result: Any) -> dict[str, Any]:
    return result.result(timeout=30) if isinstance(result, Future) else result


def visible(table: Path) -> list[dict[str, Any]]:
    """What a reader of the table sees (pyarrow skips paths starting with '_' or '.')."""
    if not table.exists():
        return []
    return ds.dataset(table, format="parquet", partitioning="hive").to_table().to_pylist()


def visible_ids(table: Path) -> list[str]:
    return sorted(row["id"] for row in visible(table))


def staged_files(table: Path) -> list[Path]:
    return sorted((table / "_staging").rglob("*.parquet"))


@pytest.fixture
def table(tmp_path: Path) -> Path:
    return tmp_path / "customer_totals"


@pytest.fixture
def sink(table: Path) -> ParquetSink:
    return ParquetSink(table, partition_by=["day"])


# --------------------------------------------------------------------------- the happy path


def test_pre_commit_stages_invisibly_and_commit_publishes(table: Path, sink: ParquetSink) -> None:
    writer, dead = make_writer(sink)
    writer.write_batch(records(rows_for(1)), 1)
    result = writer.pre_commit(1)
    assert isinstance(result, Future)
    meta = metadata(result)
    assert [p["checkpoint"] for p in meta["pending"]] == [1]
    assert staged_files(table) and visible(table) == []
    writer.commit(1)
    assert visible_ids(table) == sorted(f"1-{i}" for i in range(5))
    assert staged_files(table) == []
    published = sorted(p.relative_to(table).as_posix() for p in table.glob("day=*/*.parquet"))
    assert published == meta["pending"][0]["files"]
    assert dead == []
    writer.close()


def test_commit_is_idempotent_and_rerunnable(table: Path, sink: ParquetSink) -> None:
    writer, _ = make_writer(sink)
    writer.write_batch(records(rows_for(1)), 1)
    meta = metadata(writer.pre_commit(1))
    writer.commit(1)
    before = sorted(table.rglob("*.parquet"))
    writer.commit(1)
    writer.recover(1, meta)  # recovery re-runs the commit of the committed checkpoint
    writer.commit(1)
    assert sorted(table.rglob("*.parquet")) == before
    assert len(visible(table)) == 5
    writer.close()


def test_epochs_after_the_barrier_stay_buffered(table: Path, sink: ParquetSink) -> None:
    writer, _ = make_writer(sink)
    writer.write_batch(records(rows_for(1)), 1)
    writer.write_batch(records(rows_for(2)), 2)
    metadata(writer.pre_commit(1))
    writer.commit(1)
    assert {r["chk"] for r in visible(table)} == {1}
    metadata(writer.pre_commit(2))
    writer.commit(2)
    assert {r["chk"] for r in visible(table)} == {1, 2}
    writer.close()


def test_empty_epoch_returns_plain_metadata(sink: ParquetSink) -> None:
    writer, _ = make_writer(sink)
    assert writer.pre_commit(1) == {"format": 1, "pending": []}
    writer.commit(1)
    writer.close()


def test_single_record_writes_are_buffered(table: Path, sink: ParquetSink) -> None:
    writer, _ = make_writer(sink)
    for record in records(rows_for(1, count=20)):
        writer.write(record, 1)
    metadata(writer.pre_commit(1))
    writer.commit(1)
    assert len(visible(table)) == 20
    assert len(list(table.glob("day=*/*.parquet"))) == 1
    writer.close()


def test_checkpoint_column_holds_the_committing_checkpoint(table: Path) -> None:
    writer, _ = make_writer(ParquetSink(table, checkpoint_column="checkpoint"))
    writer.write_batch(records([{"id": "a", "v": 1}]), 7)
    metadata(writer.pre_commit(7))
    writer.commit(7)
    assert visible(table) == [{"id": "a", "v": 1, "checkpoint": 7}]
    writer.close()


def test_files_are_split_by_target_size(table: Path) -> None:
    sink = ParquetSink(table, target_file_size=4096)
    writer, _ = make_writer(sink)
    writer.write_batch(records(rows_for(1, count=3000)), 1)
    meta = metadata(writer.pre_commit(1))
    writer.commit(1)
    assert len(meta["pending"][0]["files"]) > 1
    assert len(visible(table)) == 3000
    writer.close()


def test_commit_log_records_what_each_checkpoint_published(table: Path, sink: ParquetSink) -> None:
    writer, _ = make_writer(sink)
    for n in (1, 2):
        writer.write_batch(records(rows_for(n, day=f"2024-01-0{n}")), n)
        metadata(writer.pre_commit(n))
        writer.commit(n)
    log = read_commit_log(table)
    assert [(e["job"], e["task"], e["checkpoint"], e["rows"]) for e in log] == [
        ("orders", "orders-0", 1, 5),
        ("orders", "orders-0", 2, 5),
    ]
    for entry in log:
        assert all((table / f).is_file() for f in entry["files"])
    writer.close()


# --------------------------------------------------------------------------- abort and recovery


def test_abort_discards_staged_and_buffered_data(table: Path, sink: ParquetSink) -> None:
    writer, _ = make_writer(sink)
    writer.write_batch(records(rows_for(1)), 1)
    metadata(writer.pre_commit(1))
    writer.commit(1)
    writer.write_batch(records(rows_for(2)), 2)
    metadata(writer.pre_commit(2))
    writer.write_batch(records(rows_for(3)), 3)
    writer.abort(2)
    assert staged_files(table) == []
    assert writer.pre_commit(3) == {"format": 1, "pending": []}
    writer.write_batch(records(rows_for(4)), 4)
    metadata(writer.pre_commit(4))
    writer.commit(4)
    assert {r["chk"] for r in visible(table)} == {1, 4}
    writer.close()


def test_crash_after_commit_point_is_published_by_recovery(table: Path, sink: ParquetSink) -> None:
    crashed, _ = make_writer(sink)
    crashed.write_batch(records(rows_for(1)), 1)
    meta = metadata(crashed.pre_commit(1))  # the Kafka transaction of 1 commits; then SIGKILL
    successor, _ = make_writer(sink)  # another worker, another token
    assert successor.token != crashed.token
    successor.recover(1, meta)
    assert visible_ids(table) == sorted(f"1-{i}" for i in range(5))
    assert staged_files(table) == []


def test_recovery_of_a_published_checkpoint_whose_files_were_compacted_since(
    table: Path, sink: ParquetSink
) -> None:
    """Checkpoint 1 is published, then a compaction rewrites the partition's files (or a
    retention job drops it). Recovery from 1 failed at every restart ("gone and were never
    published") although its commit-log entry proves the publish: it now recovers, and
    leaves the table as the compaction left it."""
    writer, _ = make_writer(sink)
    writer.write_batch(records(rows_for(1)), 1)
    meta = metadata(writer.pre_commit(1))
    writer.commit(1)
    writer.close()
    part = table / "day=2024-01-01"
    data = pa.concat_tables([pq.read_table(f) for f in part.glob("*.parquet")])
    for f in part.glob("*.parquet"):
        f.unlink()
    pq.write_table(data, part / "compacted-0.parquet")
    successor, _ = make_writer(sink)
    successor.recover(1, meta)
    assert visible_ids(table) == sorted(f"1-{i}" for i in range(5))
    assert [f.name for f in part.iterdir()] == ["compacted-0.parquet"]


def test_recovery_of_a_committed_checkpoint_whose_staged_files_are_gone_fails(
    table: Path, sink: ParquetSink
) -> None:
    """Without a commit-log entry, staged files a committed checkpoint names that are gone
    and were never published are lost output: recovery says so instead of going on."""
    crashed, _ = make_writer(sink)
    crashed.write_batch(records(rows_for(1)), 1)
    meta = metadata(crashed.pre_commit(1))
    for staged in (table / "_staging").iterdir():
        shutil.rmtree(staged)
    successor, _ = make_writer(sink)
    with pytest.raises(SinkError, match="gone and were never published"):
        successor.recover(1, meta)


def test_recovery_keeps_newer_staging_until_a_newer_checkpoint_commits(
    table: Path, sink: ParquetSink
) -> None:
    """Staged checkpoint 2 is newer than the committed 1: its owner may still commit it, so
    recovery leaves it; once the successor commits 2 itself, the old staging is dead."""
    crashed, _ = make_writer(sink)
    crashed.write_batch(records(rows_for(1)), 1)
    meta1 = metadata(crashed.pre_commit(1))
    crashed.write_batch(records(rows_for(2)), 2)
    metadata(crashed.pre_commit(2))  # staged, but its Kafka transaction never committed
    crashed_files = [f for f in staged_files(table) if "/0000000002-" in str(f)]
    assert crashed_files
    successor, _ = make_writer(sink)
    successor.recover(1, meta1)
    assert {r["chk"] for r in visible(table)} == {1}
    assert staged_files(table) == crashed_files
    successor.write_batch(records([{**r, "id": f"s{r['id']}"} for r in rows_for(2)]), 2)
    metadata(successor.pre_commit(2))
    successor.commit(2)
    assert sorted(r["id"] for r in visible(table) if r["chk"] == 2) == [f"s2-{i}" for i in range(5)]
    assert staged_files(table) == []


def test_recovery_with_nothing_committed_deletes_nothing(table: Path, sink: ParquetSink) -> None:
    crashed, _ = make_writer(sink)
    crashed.write_batch(records(rows_for(1)), 1)
    metadata(crashed.pre_commit(1))
    successor, _ = make_writer(sink)
    successor.recover(None, None)
    assert visible(table) == [] and len(staged_files(table)) == 1
    successor.write_batch(records(rows_for(1, count=2)), 1)
    metadata(successor.pre_commit(1))
    successor.commit(1)
    assert len(visible(table)) == 2 and staged_files(table) == []


def test_zombie_recovery_with_stale_offsets_keeps_the_owners_checkpoint(
    table: Path, sink: ParquetSink
) -> None:
    """Issue 9 item 1: a zombie re-ran recovery from checkpoint 1 (stale offsets) while the
    new owner had staged checkpoint 2 and was committing it; the owner's files must survive
    and publish, and the zombie's own later staging must never become visible."""
    first, _ = make_writer(sink)
    first.write_batch(records(rows_for(1)), 1)
    meta1 = metadata(first.pre_commit(1))
    first.commit(1)
    owner, _ = make_writer(sink)
    owner.recover(1, meta1)
    owner.write_batch(records(rows_for(2)), 2)
    metadata(owner.pre_commit(2))  # staged; the owner's Kafka commit of 2 is under way
    zombie, _ = make_writer(sink)
    zombie.recover(1, meta1)  # read the offsets before the owner's commit landed
    zombie.write_batch(records([{**r, "id": f"z{r['id']}"} for r in rows_for(2)]), 2)
    metadata(zombie.pre_commit(2))  # its commit is fenced and never happens
    owner.commit(2)  # the commit point of 2 passed for the owner
    assert visible_ids(table) == sorted(f"{c}-{i}" for c in (1, 2) for i in range(5))
    owner.write_batch(records(rows_for(3)), 3)
    meta3 = metadata(owner.pre_commit(3))
    owner.commit(3)
    later, _ = make_writer(sink)
    later.recover(3, meta3)
    assert visible_ids(table) == sorted(f"{c}-{i}" for c in (1, 2, 3) for i in range(5))
    assert staged_files(table) == []  # the zombie's 2 is dead once 3 committed


def test_table_of_another_cluster_is_refused(table: Path, sink: ParquetSink) -> None:
    def writer(cluster: str) -> ParquetSinkWriter:
        context = SinkContext(
            "orders",
            "orders-0",
            "w",
            sink.name,
            None,
            lambda *_: None,
            cluster,  # type: ignore[arg-type]
        )
        return sink.open(context)

    writer("cluster-a").close()
    writer("cluster-a").close()
    with pytest.raises(ConfigurationError, match="cluster-a.*cluster-b|cluster cluster-a"):
        writer("cluster-b")


def test_metadata_names_every_unpublished_checkpoint(table: Path, sink: ParquetSink) -> None:
    crashed, _ = make_writer(sink)
    crashed.write_batch(records(rows_for(1)), 1)
    metadata(crashed.pre_commit(1))
    crashed.write_batch(records(rows_for(2)), 2)
    meta2 = metadata(crashed.pre_commit(2))  # commit(1) never ran before the crash
    assert [p["checkpoint"] for p in meta2["pending"]] == [1, 2]
    successor, _ = make_writer(sink)
    successor.recover(2, meta2)
    assert {r["chk"] for r in visible(table)} == {1, 2}
    assert len(visible(table)) == 10


def test_crash_in_the_middle_of_publishing_is_finished(
    table: Path, sink: ParquetSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed, _ = make_writer(sink)
    for day in ("2024-01-01", "2024-01-02", "2024-01-03"):
        crashed.write_batch(records(rows_for(1, day=day)), 1)
    meta = metadata(crashed.pre_commit(1))
    assert len(meta["pending"][0]["files"]) == 3
    renames = 0
    real_rename = os.rename

    def crash_after_one(source: Any, target: Any) -> None:
        nonlocal renames
        if renames == 1:
            raise KeyboardInterrupt("SIGKILL")
        renames += 1
        real_rename(source, target)

    monkeypatch.setattr(parquet_module.os, "rename", crash_after_one)
    with pytest.raises(KeyboardInterrupt):
        crashed.commit(1)
    monkeypatch.setattr(parquet_module.os, "rename", real_rename)
    assert len(visible(table)) == 5  # one partition published, two still staged
    successor, _ = make_writer(sink)
    successor.recover(1, meta)
    assert len(visible(table)) == 15
    assert len({r["id"] + r["day"] for r in visible(table)}) == 15


def test_commit_log_intent_alone_finishes_a_publish(
    table: Path, sink: ParquetSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashed, _ = make_writer(sink)
    crashed.write_batch(records(rows_for(1, day="a") + rows_for(1, day="b")), 1)
    metadata(crashed.pre_commit(1))
    monkeypatch.setattr(parquet_module.os, "rename", _raise_interrupt)
    with pytest.raises(KeyboardInterrupt):
        crashed.commit(1)
    monkeypatch.undo()
    # Even without the checkpoint's metadata, the intent proves checkpoint 1 committed.
    successor, _ = make_writer(sink)
    successor.recover(1, None)
    assert len(visible(table)) == 10


def test_a_corrupt_commit_log_intent_is_detected_not_half_published(
    table: Path, sink: ParquetSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One changed byte in the intent's file list would publish the wrong files and discard
    # the others as dead (rows lost, no error): recovery must refuse and touch nothing.
    crashed, _ = make_writer(sink)
    crashed.write_batch(records(rows_for(1, day="a") + rows_for(1, day="b")), 1)
    meta = metadata(crashed.pre_commit(1))
    monkeypatch.setattr(parquet_module.os, "rename", _raise_interrupt)
    with pytest.raises(KeyboardInterrupt):
        crashed.commit(1)
    monkeypatch.undo()
    (intent,) = (table / "_commits").rglob("0000000001-*.json")
    entry = orjson.loads(intent.read_bytes())
    entry["files"][1] = entry["files"][0]  # as if bytes of the second name had changed
    intent.write_bytes(orjson.dumps(entry))
    staged = staged_files(table)
    successor, _ = make_writer(sink)
    with pytest.raises(SinkError, match="failed its checksum"):
        successor.recover(1, meta)
    assert staged_files(table) == staged and visible(table) == []


def _raise_interrupt(*_: Any) -> None:
    raise KeyboardInterrupt("SIGKILL")


def test_zombie_staging_is_never_published(table: Path, sink: ParquetSink) -> None:
    zombie, _ = make_writer(sink)
    zombie.write_batch(records(rows_for(1)), 1)
    meta1 = metadata(zombie.pre_commit(1))
    zombie.commit(1)
    owner, _ = make_writer(sink)
    owner.recover(1, meta1)
    # The zombie has not noticed it lost the task and stages checkpoint 2 as well.
    zombie.write_batch(records([{**r, "id": "zombie-" + r["id"]} for r in rows_for(2)]), 2)
    metadata(zombie.pre_commit(2))
    owner.write_batch(records(rows_for(2)), 2)
    meta2 = metadata(owner.pre_commit(2))
    owner.commit(2)
    assert not any(r["id"].startswith("zombie") for r in visible(table))
    assert len(visible(table)) == 10
    assert staged_files(table)  # the zombie's files, hidden; the next recovery drops them
    later, _ = make_writer(sink)
    later.recover(2, meta2)
    assert staged_files(table) == []
    assert len(visible(table)) == 10


def test_lost_staged_files_of_a_committed_checkpoint_raise(table: Path, sink: ParquetSink) -> None:
    crashed, _ = make_writer(sink)
    crashed.write_batch(records(rows_for(1)), 1)
    meta = metadata(crashed.pre_commit(1))
    for path in staged_files(table):
        path.unlink()
    import shutil

    shutil.rmtree(table / "_staging")
    successor, _ = make_writer(sink)
    with pytest.raises(SinkError, match="gone"):
        successor.recover(1, meta)


def test_tasks_of_one_table_do_not_touch_each_other(table: Path, sink: ParquetSink) -> None:
    first, _ = make_writer(sink, task="orders-0")
    second, _ = make_writer(sink, task="orders-1")
    first.write_batch(records(rows_for(1)), 1)
    second.write_batch(records([{**r, "id": "b" + r["id"]} for r in rows_for(1)]), 1)
    metadata(first.pre_commit(1))
    metadata(second.pre_commit(1))
    first.commit(1)
    second.recover(None, None)  # task orders-1 restarts with nothing committed
    assert len(visible(table)) == 5
    restarted, _ = make_writer(sink, task="orders-1")
    restarted.recover(None, None)
    first.recover(1, None)
    assert len(visible(table)) == 5


# --------------------------------------------------------------------------- schema and rows


def test_rows_that_do_not_fit_go_to_dead_letters(table: Path) -> None:
    schema = pa.schema(
        [
            pa.field("id", pa.string(), nullable=False),
            pa.field("qty", pa.int64()),
            pa.field("price", pa.float64()),
        ]
    )
    writer, dead = make_writer(ParquetSink(table, schema=schema))
    rows = [
        {"id": "ok", "qty": 1, "price": 2.5},
        {"id": "castable", "qty": "7", "price": "1.25"},
        {"id": "integral-float", "qty": 3.0, "price": 1},
        {"qty": 1, "price": 1.0},
        {"id": "bad-int", "qty": "seven", "price": 1.0},
        {"id": "fraction", "qty": 1.5, "price": 1.0},
        {"id": "overflow", "qty": 2**70, "price": 1.0},
        ["not", "a", "dict"],
    ]
    writer.write_batch(records(rows), 3)
    metadata(writer.pre_commit(3))
    writer.commit(3)
    got = {r["id"]: r for r in visible(table)}
    assert set(got) == {"ok", "castable", "integral-float"}
    assert got["castable"] == {"id": "castable", "qty": 7, "price": 1.25}
    assert got["integral-float"]["qty"] == 3
    reasons = {str(value): reason for value, reason, _ in dead}
    assert len(dead) == 5 and all(epoch == 3 for _, _, epoch in dead)
    assert "missing required column 'id'" in reasons[str(rows[3])]
    assert "'qty'" in reasons[str(rows[4])] and "int64" in reasons[str(rows[4])]
    assert "'qty'" in reasons[str(rows[5])]
    assert "needs a dict" in reasons[str(rows[7])]
    writer.close()


def test_schema_is_inferred_once_and_shared_by_tasks(table: Path) -> None:
    sink = ParquetSink(table)
    first, _ = make_writer(sink, task="t-0")
    first.write_batch(records([{"id": "a", "n": 1, "note": None}]), 1)
    metadata(first.pre_commit(1))
    first.commit(1)
    second, dead = make_writer(sink, task="t-1")
    second.write_batch(
        records([{"id": "b", "n": 2.0, "note": "x", "extra": True}, {"id": "c", "n": "many"}]), 1
    )
    metadata(second.pre_commit(1))
    second.commit(1)
    schema = ds.dataset(table, format="parquet").schema
    assert schema.field("n").type == pa.int64() and schema.field("note").type == pa.string()
    assert "extra" not in schema.names
    assert sorted(r["id"] for r in visible(table)) == ["a", "b"]
    assert [v["id"] for v, _, _ in dead] == ["c"]


def test_a_changed_byte_of_the_table_schema_is_detected_at_open(table: Path) -> None:
    """A renamed column in _schema.arrow made the next writers drop that column's values (a
    warning per job); now the file fails its checksum when a writer opens. A schema file
    written before checksums is still read."""
    sink = ParquetSink(table)
    first, _ = make_writer(sink, task="t-0")
    first.write_batch(records(rows_for(1)), 1)
    metadata(first.pre_commit(1))
    first.commit(1)
    path = table / parquet_module.SCHEMA_FILE
    good = path.read_bytes()
    assert good.count(b"amount") == 1
    path.write_bytes(good.replace(b"amount", b"amounu"))
    with pytest.raises(SinkError, match="_schema.arrow failed its checksum; restore it"):
        make_writer(sink, task="t-1")
    legacy = pa.ipc.read_schema(pa.py_buffer(good)).remove_metadata()
    path.write_bytes(legacy.serialize().to_pybytes())
    second, _ = make_writer(sink, task="t-1")
    second.write_batch(records(rows_for(2)), 2)
    metadata(second.pre_commit(2))
    second.commit(2)
    assert sorted(r["amount"] for r in visible(table)) == sorted([float(i) for i in range(5)] * 2)


def test_infer_schema_takes_every_key_and_widens_numbers() -> None:
    schema = infer_schema([{"a": 1}, {"a": 2.5, "b": "x"}, {"c": None}])
    assert schema == pa.schema([("a", pa.float64()), ("b", pa.string()), ("c", pa.string())])


def test_partition_values_are_escaped_and_read_back(table: Path) -> None:
    writer, _ = make_writer(ParquetSink(table, partition_by=["region", "day"]))
    rows = [
        {"id": 1, "region": "eu/west", "day": date(2024, 1, 1)},
        {"id": 2, "region": "a=b?c", "day": date(2024, 1, 2)},
        {"id": 3, "region": None, "day": date(2024, 1, 2)},
    ]
    writer.write_batch(records(rows), 1)
    metadata(writer.pre_commit(1))
    writer.commit(1)
    assert (table / "region=eu%2Fwest" / "day=2024-01-01").is_dir()
    assert (table / "region=__HIVE_DEFAULT_PARTITION__").is_dir()
    got = {r["id"]: r["region"] for r in visible(table)}
    assert got == {1: "eu/west", 2: "a=b?c", 3: None}
    writer.close()


def test_hive_partition_dir() -> None:
    assert hive_partition_dir(["d", "ok"], [date(2024, 5, 6), True]) == "d=2024-05-06/ok=true"
    assert hive_partition_dir(["k"], ["50%:x"]) == "k=50%25%3Ax"
    assert hive_partition_dir(["k"], [""]) == "k=__HIVE_DEFAULT_PARTITION__"


def test_odd_task_ids_make_safe_distinct_paths(table: Path, sink: ParquetSink) -> None:
    names = set()
    for task in ("orders/0", "orders_0", "../x", ".hidden"):
        writer, _ = make_writer(sink, task=task)
        writer.write_batch(records(rows_for(1)), 1)
        metadata(writer.pre_commit(1))
        writer.commit(1)
        names.add(writer.staging_root.name)
        assert writer.staging_root.parent.parent.parent == table / "_staging"
    assert len(names) == 4
    assert len(visible(table)) == 20


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": ""}, "empty path"),
        ({"path": "s3://bucket/table"}, "URI"),
        ({"path": "t", "compression": "lzma"}, "compression"),
        ({"path": "t", "partition_by": ["_day"]}, "start with"),
        ({"path": "t", "target_file_size": 10}, "target_file_size"),
        (
            {"path": "t", "schema": pa.schema([("a", pa.int64())]), "partition_by": ["day"]},
            "not in the given schema",
        ),
        (
            {
                "path": "t",
                "schema": pa.schema([("a", pa.float64()), ("b", pa.int64())]),
                "partition_by": ["a"],
            },
            "integer, string",
        ),
        (
            {"path": "t", "schema": pa.schema([("a", pa.int64())]), "checkpoint_column": "a"},
            "checkpoint_column",
        ),
    ],
)
def test_configuration_errors_name_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ParquetSink(**kwargs)


def test_pre_commit_hands_over_immutable_batches(
    table: Path, sink: ParquetSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    release = threading.Event()
    real_stage: Callable[..., Any] = parquet_module._stage_files

    def slow_stage(job: Any) -> Any:
        release.wait(10)
        return real_stage(job)

    monkeypatch.setattr(parquet_module, "_stage_files", slow_stage)
    writer, _ = make_writer(sink)
    writer.write_batch(records(rows_for(1)), 1)
    result = writer.pre_commit(1)
    assert isinstance(result, Future) and not result.done()  # the task thread is not blocked
    writer.write_batch(records(rows_for(2)), 2)  # the next epoch goes on meanwhile
    release.set()
    metadata(result)
    writer.commit(1)
    assert {r["chk"] for r in visible(table)} == {1}
    writer.close()


def test_two_sinks_of_one_job_share_a_table(table: Path) -> None:
    orders, _ = make_writer(ParquetSink(table, name="orders-out"))
    refunds, _ = make_writer(ParquetSink(table, name="refunds-out"))
    orders.write_batch(records(rows_for(1)), 1)
    refunds.write_batch(records([{**r, "id": "r" + r["id"]} for r in rows_for(1)]), 1)
    orders_meta = metadata(orders.pre_commit(1))
    refunds_meta = metadata(refunds.pre_commit(1))
    # Task orders-0 restarts: each sink's writer recovers its own staging only.
    make_writer(ParquetSink(table, name="orders-out"))[0].recover(1, orders_meta)
    make_writer(ParquetSink(table, name="refunds-out"))[0].recover(1, refunds_meta)
    assert len(visible(table)) == 10
    assert {e["sink"] for e in read_commit_log(table)} == {"orders-out", "refunds-out"}


def test_recovery_after_the_commit_log_was_pruned(table: Path, sink: ParquetSink) -> None:
    writer, _ = make_writer(sink)
    writer.write_batch(records(rows_for(1)), 1)
    meta = metadata(writer.pre_commit(1))
    writer.commit(1)
    for entry in (table / "_commits").rglob("*.json"):
        entry.unlink()  # old commit-log entries are history
    successor, _ = make_writer(sink)
    successor.recover(1, meta)
    assert len(visible(table)) == 5


def test_the_table_schema_is_logged_once_per_job(
    table: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sink = ParquetSink(table)
    writers = [make_writer(sink, task=f"t-{i}")[0] for i in range(3)]  # all open before a row
    with caplog.at_level("INFO", logger="snapline.sinks.parquet"):
        for i, writer in enumerate(writers):
            writer.write_batch(records([{"id": f"r{i}", "n": i}]), 1)
            metadata(writer.pre_commit(1))
    assert sum("table schema" in r.getMessage() for r in caplog.records) == 1
    for writer in writers:
        writer.close()


def test_a_column_not_in_the_schema_is_warned_about_in_any_row(
    table: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the first row of each batch was checked: a key a later row brought (a field
    added upstream) was dropped with no word. Every row is checked now, each column warned
    about once."""
    writer, _ = make_writer(ParquetSink(table))
    writer.write_batch(records(rows_for(1)), 1)  # the schema: id, customer, amount, day, chk
    later = rows_for(2)
    later[3] = {**later[3], "currency": "EUR"}
    later[4] = {**later[4], "currency": "USD"}
    with caplog.at_level("WARNING", logger="snapline.sinks.parquet"):
        writer.write_batch(records(later), 2)
        metadata(writer.pre_commit(2))
    warned = [r.getMessage() for r in caplog.records if "not in the table schema" in r.getMessage()]
    assert len(warned) == 1 and "['currency']" in warned[0]


# --------------------------------------------------------------------------- storage outages


@pytest.mark.parametrize(
    ("error", "unavailable"),
    [
        (OSError(errno.ESTALE, "Stale file handle"), True),
        (OSError(errno.ENOTCONN, "Transport endpoint is not connected"), True),
        (OSError(errno.EHOSTUNREACH, "No route to host"), True),
        (OSError(errno.EACCES, "Permission denied"), False),
        (OSError(errno.ENOSPC, "No space left on device"), False),
    ],
)
def test_an_unreachable_storage_is_a_sink_outage_and_a_refusal_is_not(
    table: Path,
    sink: ParquetSink,
    monkeypatch: pytest.MonkeyPatch,
    error: OSError,
    unavailable: bool,
) -> None:
    """A network filesystem or object store that cannot be reached, while staging, publishing
    or recovering, raises SinkUnavailableError: the worker exits 75 and is restarted with
    backoff (worker.unavailable_sink). A refusal (permissions, a full disk) stays an error."""
    writer, _ = make_writer(sink)
    writer.write_batch(records(rows_for(1)), 1)
    meta = metadata(writer.pre_commit(1))
    writer.write_batch(records(rows_for(2)), 2)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise error

    monkeypatch.setattr(parquet_module, "_fsync_path", fail)
    staging = writer.pre_commit(2)
    assert isinstance(staging, Future)
    with pytest.raises(Exception) as staged:
        staging.result(timeout=30)
    with pytest.raises(Exception) as published:
        writer.commit(1)
    with pytest.raises(Exception) as recovered:
        writer.recover(1, meta)
    for raised in (staged.value, published.value, recovered.value):
        assert (unavailable_sink(raised) is not None) is unavailable
        assert isinstance(raised, SinkUnavailableError) is unavailable
        assert isinstance(raised, (SinkError, OSError))
        assert error in error_chain(raised), "raised for another reason than the storage's"
    monkeypatch.undo()
    writer.recover(1, meta)  # the storage is back: the committed checkpoint is published
    assert visible_ids(table) == sorted(f"1-{i}" for i in range(5))
    writer.close()


def test_a_row_whose_partition_directory_is_too_long_is_a_dead_letter(table: Path) -> None:
    """A partition value over 255 bytes once escaped made staging fail with ENAMETOOLONG:
    every checkpoint failed, and every restart replayed the row. Now the row is a dead
    letter naming the column; the other rows of its checkpoint are published."""
    sink = ParquetSink(table, partition_by=["day"])
    writer, dead = make_writer(sink)
    rows = rows_for(1, count=3)
    rows[1]["day"] = "/" * 90  # 270 bytes once escaped (%2F)
    writer.write_batch(records(rows), 1)
    metadata(writer.pre_commit(1))
    writer.commit(1)
    assert visible_ids(table) == ["1-0", "1-2"]
    [(value, reason, epoch)] = dead
    assert value["id"] == "1-1" and epoch == 1
    assert "over the 255 a filesystem takes for a name" in reason and "'day'" in reason
    writer.close()
