"""`snapline spark run --run-id ID`: a re-run covers the range its first run recorded, and a
run's transactional ids are its job's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapline.pipeline.checkpoint.metadata import encode_checked
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CorruptCheckpointError
from snapline.pipeline.spark.bounded import _run_range, _transactional_id, _used_legacy_ids


def test_a_rerun_keeps_the_range_its_first_run_recorded(tmp_path: Path) -> None:
    """A re-run after more input arrived computed --to latest again: its committed tasks
    re-published their output over the old range while its savepoint claimed the new end, so
    the records in between were never output (an audit's repro: 4 of 9 records). The range
    is recorded before the first task and read back."""
    storage = CheckpointStorage(str(tmp_path))
    said: list[str] = []
    first = ({("in", 0): 0, ("in", 1): 0}, {("in", 0): 3, ("in", 1): 2})
    assert _run_range(storage, "job", "r1", *first, said.append) == first
    grown = ({("in", 0): 0, ("in", 1): 0}, {("in", 0): 5, ("in", 1): 4})
    assert _run_range(storage, "job", "r1", *grown, said.append) == first
    assert said == ["run r1 again: over its recorded source range, not the one asked now"]
    assert _run_range(storage, "job", "r2", *grown, said.append) == grown  # another run
    path = tmp_path / "job" / "spark" / "r1" / "_range.json"
    path.write_bytes(path.read_bytes().replace(b'"in",0,3', b'"in",0,9'))
    with pytest.raises(CorruptCheckpointError):
        _run_range(storage, "job", "r1", *grown, said.append)


def test_two_jobs_tasks_of_one_run_id_have_their_own_transactional_ids() -> None:
    task = "spark-backfill-p0"
    assert _transactional_id("orders", task) != _transactional_id("payments", task)
    assert _transactional_id("orders", task) == _transactional_id("orders", task)


def test_a_run_an_earlier_version_may_have_run_also_fences_its_transactional_ids(
    tmp_path: Path,
) -> None:
    """Versions before per-job transactional ids gave a task ``snapline-spark-<run>-<task>``:
    a re-run of such a run must fence that id too, or an attempt of the old version still
    running could commit after the re-run read the ledger."""
    storage = CheckpointStorage(str(tmp_path))
    say: list[str] = []
    offsets = ({("in", 0): 0}, {("in", 0): 3})
    assert not _used_legacy_ids(storage, "job", "new")  # a first run
    _run_range(storage, "job", "new", *offsets, say.append)
    assert not _used_legacy_ids(storage, "job", "new")  # its re-run
    # A range an earlier version recorded (no "transactional_ids"):
    body = {"starts": [["in", 0, 0]], "ends": [["in", 0, 3]]}
    storage.write_bytes("job/spark/old/_range.json", encode_checked(body))
    assert _used_legacy_ids(storage, "job", "old")
    # A version before recorded ranges left only its attempts' records:
    storage.write_bytes("job/spark/older/spark-older-p0-1a2b.json", b"{}")
    assert _used_legacy_ids(storage, "job", "older")


def test_a_range_kafka_no_longer_holds_in_full_is_refused_before_spark_runs() -> None:
    """Spark's Kafka source was given failOnDataLoss=false: it skipped records of the range
    that retention deleted, and read an end past the partition's end as far as there was,
    while the run's savepoint claimed the whole range (review repro: 41 of 100 records)."""
    from snapline.pipeline.errors import ConfigurationError
    from snapline.pipeline.spark.bounded import _check_range

    class Probe:
        marks = {("in", 0): (60, 102), ("in", 1): (0, 10)}

        def get_watermark_offsets(self, tp, timeout):  # type: ignore[no-untyped-def]
            return self.marks[(tp.topic, tp.partition)]

    _check_range(Probe(), {("in", 0): 60, ("in", 1): 0}, {("in", 0): 102, ("in", 1): 10})
    _check_range(Probe(), {("in", 0): 5, ("in", 1): 0}, {("in", 0): 5, ("in", 1): 10})  # empty
    with pytest.raises(ConfigurationError) as raised:
        _check_range(Probe(), {("in", 0): 0, ("in", 1): 0}, {("in", 0): 102, ("in", 1): 100})
    message = str(raised.value)
    assert "in[0]: offsets [0, 60) were deleted (the log starts at 60 now)" in message
    assert "in[1]: offsets [10, 100) are not in Kafka (the partition ends at 10" in message


def test_a_rerun_must_start_from_the_savepoint_its_first_run_started_from(
    tmp_path: Path,
) -> None:
    """Found by review: the range was recorded, its --from not. A run from a savepoint takes
    its state, clocks and records in flight from it; re-run without that --from, its tasks
    not yet committed ran the recorded range from empty state and without the records in
    flight (lost from every sink and from the savepoint handed to the services), and a
    re-run from a savepoint the first run did not start from counted its state twice."""
    from snapline.pipeline.errors import ConfigurationError

    storage = CheckpointStorage(str(tmp_path))
    said: list[str] = []
    offsets = ({("in", 0): 4}, {("in", 0): 9})
    assert _run_range(storage, "job", "r1", *offsets, said.append, "savepoint:/sp/1") == offsets
    assert _run_range(storage, "job", "r1", *offsets, said.append, "savepoint:/sp/1") == offsets
    for other in ("earliest", "savepoint:/sp/2"):
        with pytest.raises(ConfigurationError, match="run r1 was started with --from savepoint"):
            _run_range(storage, "job", "r1", *offsets, said.append, other)
    assert _run_range(storage, "job", "r2", *offsets, said.append, "earliest") == offsets
    with pytest.raises(ConfigurationError, match="run it again with the --from it started"):
        _run_range(storage, "job", "r2", *offsets, said.append, "savepoint:/sp/1")
    # between two positions the recorded range decides, as before
    assert _run_range(storage, "job", "r2", *offsets, said.append, "latest") == offsets


def test_a_state_file_written_again_by_another_attempt_is_named_as_it_is_now(
    tmp_path: Path,
) -> None:
    """Found by review: a task attempt run again after the task's commit (Spark lost the
    results it kept, or a speculative attempt) exported its state again to the same file
    after the driver had taken the first attempt's entry; with wall-clock TTL stamps the
    bytes differed, and every restore of the savepoint failed the file's checksum."""
    import pyarrow as pa

    from snapline.pipeline.savepoint.format import read_table, write_table
    from snapline.pipeline.spark.bounded import files_as_written

    storage = CheckpointStorage(str(tmp_path))
    path = "operators/total/p00000.parquet"
    first = write_table(storage, path, pa.table({"key": [b"a"], "ttl": [1000]}), partition=0)
    kept = write_table(storage, "operators/total/p00001.parquet", pa.table({"key": [b"b"]}))
    write_table(storage, path, pa.table({"key": [b"a", b"c"], "ttl": [2000, 2001]}), partition=0)
    with pytest.raises(CorruptCheckpointError):
        read_table(storage, first)
    said: list[str] = []
    files = files_as_written(storage, {"total": [first, kept]}, said.append)
    (now, same) = files["total"]
    assert same == kept and now.partition == 0 and now.rows == 2
    assert read_table(storage, now).column("ttl").to_pylist() == [2000, 2001]
    assert said == [f"{path} was written again by another attempt of its task after its first "
                    "entry was taken: the savepoint names the file as it is now"]  # fmt: skip


def test_a_savepoint_start_is_recorded_without_its_credentials(tmp_path: Path) -> None:
    """Found by review: ``--from savepoint:s3://KEY:SECRET@...`` was recorded as given in the
    run's range file, putting the credentials into checkpoint storage. It is recorded
    redacted; a re-run from the same savepoint with other (rotated) credentials runs from the
    same savepoint, one from another savepoint is still refused, and neither the file nor the
    refusal shows a secret."""
    from snapline.pipeline.errors import ConfigurationError

    storage = CheckpointStorage(str(tmp_path))
    said: list[str] = []
    offsets = ({("in", 0): 4}, {("in", 0): 9})
    start = "savepoint:s3://AKIAFAKE:FAKESECRET@bucket/sp/1"
    assert _run_range(storage, "job", "r1", *offsets, said.append, start) == offsets
    recorded = (tmp_path / "job" / "spark" / "r1" / "_range.json").read_bytes()
    assert b"FAKESECRET" not in recorded and b"AKIAFAKE" not in recorded
    assert b"savepoint:s3://***@bucket/sp/1" in recorded
    rotated = "savepoint:s3://AKIAOTHER:OTHERSECRET@bucket/sp/1"
    assert _run_range(storage, "job", "r1", *offsets, said.append, rotated) == offsets
    assert _run_range(storage, "job", "r1", *offsets, said.append, start) == offsets
    for other in ("savepoint:s3://AKIAFAKE:FAKESECRET@bucket/sp/2", "earliest"):
        with pytest.raises(ConfigurationError, match="run r1 was started with --from") as refused:
            _run_range(storage, "job", "r1", *offsets, said.append, other)
        assert "FAKESECRET" not in str(refused.value) and "AKIAFAKE" not in str(refused.value)
    # A range an earlier version recorded with the credentials still matches its savepoint.
    body = {"starts": [["in", 4, 4]], "ends": [["in", 4, 9]], "from": start}
    storage.write_bytes("job/spark/old/_range.json", encode_checked(body))
    offsets = ({("in", 4): 4}, {("in", 4): 9})
    assert _run_range(storage, "job", "old", *offsets, said.append, rotated) == offsets
    with pytest.raises(ConfigurationError) as refused:
        _run_range(storage, "job", "old", *offsets, said.append, "earliest")
    assert "FAKESECRET" not in str(refused.value)
    assert said == []
