"""Savepoints record the ids of the source topics their offsets were read in (Kafka gives a
topic deleted and created again a new id, and its offsets start at 0 again): a restore of a
savepoint whose source topic was recreated since is refused before Kafka is changed, unless
``--read-recreated-topics``; the seeded checkpoints record the ids, so the worker's restore
check (``Worker._recreated_topics``) covers a savepoint start too. Pure logic; the services
and Spark on a real broker are in integration_tests/test_topic_recreated.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

from snapline.connectors import KafkaSource
from snapline.pipeline import Pipeline
from snapline.pipeline.checkpoint.storage import CheckpointStorage, crc32_checksum
from snapline.pipeline.errors import CheckpointError, ConfigurationError
from snapline.pipeline.runtime.topics import NO_TOPIC_ID, recreated_since
from snapline.pipeline.savepoint import restore
from snapline.pipeline.savepoint.export import _merge_topic_ids
from snapline.pipeline.savepoint.format import SavepointMetadata, read_metadata
from snapline.sinks import KafkaSink

OLD, NEW = "b1d3Xg2oQmKcP1xyZ0aaaa", "Qk7sLw9eR5uT3vYx1bbbbb"


def test_the_ids_round_trip_and_older_savepoints_have_none(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "sp"))
    meta = SavepointMetadata(
        "job", "0.1.0", 128, {"in": {0: 5}}, {"in": 1}, [], [], source_topic_ids={"in": OLD}
    )
    storage.write_bytes("_savepoint.json", meta.encode())
    assert read_metadata(storage).source_topic_ids == {"in": OLD}

    # A savepoint written before the field existed: its body has no "source_topic_ids".
    body = orjson.loads(meta.encode())["body"]
    del body["source_topic_ids"]
    raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)
    older = orjson.dumps({"body": orjson.Fragment(raw), "checksum": crc32_checksum(raw)})
    assert SavepointMetadata.decode(older, "old").source_topic_ids == {}


def test_a_recreation_is_told_only_by_two_real_ids() -> None:
    assert recreated_since({"in": OLD, "in2": OLD}, {"in": NEW, "in2": OLD}) == ["in"]
    # no id then or now (old brokers, a cluster given ids for the first time): not told
    assert recreated_since({"in": NO_TOPIC_ID}, {"in": NEW}) == []
    assert recreated_since({"in": OLD}, {"in": ""}) == []
    assert recreated_since({}, {"in": NEW}) == []


def test_checkpoints_that_read_two_topics_of_one_name_make_no_savepoint() -> None:
    ids: dict[str, str] = {}
    _merge_topic_ids(ids, {"in": OLD, "job.by-x.repartition": NEW}, {"in"}, "p0")
    _merge_topic_ids(ids, {"in": OLD}, {"in"}, "p1")
    _merge_topic_ids(ids, {"in": ""}, {"in"}, "p2")  # a checkpoint without an id: no vote
    assert ids == {"in": OLD}  # repartition topics are recreated by every restore: left out
    with pytest.raises(CheckpointError, match="two topics named in .*task p3"):
        _merge_topic_ids(ids, {"in": NEW}, {"in"}, "p3")


def _pipeline() -> Pipeline:
    pipeline = Pipeline("job")
    pipeline.source(KafkaSource(("in", "in2"))).sink(KafkaSink("out"))
    return pipeline


def _savepoint(ids: dict[str, str]) -> SavepointMetadata:
    return SavepointMetadata(
        "job", "0.1.0", 128, {"in": {0: 5}}, {"in": 1, "in2": 1}, [], [], source_topic_ids=ids
    )


def _ids_now(monkeypatch: pytest.MonkeyPatch, now: dict[str, str]) -> None:
    def describe(_admin: Any, topics: Any, _what: str) -> dict[str, str]:
        return {t: now[t] for t in topics if t in now}

    monkeypatch.setattr(restore, "describe_topic_ids", describe)


def test_a_restore_refuses_a_savepoint_of_a_recreated_source_topic(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _ids_now(monkeypatch, {"in": NEW, "in2": OLD})
    savepoint = _savepoint({"in": OLD, "in2": OLD})
    with pytest.raises(ConfigurationError) as refused:
        restore._source_topic_ids(None, _pipeline(), savepoint, "file:///sp", False)
    message = str(refused.value)
    assert f"source topics in (id {OLD}, now {NEW}) were deleted and created again" in message
    assert "stopped before changing" in message and "--read-recreated-topics" in message

    # Allowed: logged, and the seeded checkpoints keep the savepoint's ids, so the worker's
    # restore meets the new id and reads the topic from its start.
    with caplog.at_level(logging.ERROR):
        ids = restore._source_topic_ids(None, _pipeline(), savepoint, "file:///sp", True)
    assert ids == {"in": OLD, "in2": OLD}
    assert "reads them from their start" in caplog.text


def test_a_savepoint_without_ids_seeds_the_ids_of_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """A savepoint of an earlier version (no ids): nothing can be told about the time before
    the restore, but the seeded checkpoints record today's ids, so a recreation after the
    restore is caught by the worker like any other."""
    _ids_now(monkeypatch, {"in": NEW, "in2": ""})
    ids = restore._source_topic_ids(None, _pipeline(), _savepoint({}), "file:///sp", False)
    assert ids == {"in": NEW}


def test_ids_of_another_cluster_are_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job moved to another cluster (a savepoint's documented use): Kafka gives every topic
    there another id, whatever its records. Compared, every source topic would look created
    again, and --read-recreated-topics would send everything to the sinks again."""
    _ids_now(monkeypatch, {"in": NEW, "in2": NEW})
    monkeypatch.setattr(restore, "cluster_id_of", lambda _admin: "cluster-b")
    savepoint = _savepoint({"in": OLD, "in2": OLD})
    moved = SavepointMetadata(**{**savepoint.__dict__, "cluster_id": "cluster-a"})
    ids = restore._source_topic_ids(None, _pipeline(), moved, "file:///sp", False)
    assert ids == {"in": NEW, "in2": NEW}  # the seeded checkpoints get this cluster's ids
    same = SavepointMetadata(**{**savepoint.__dict__, "cluster_id": "cluster-b"})
    with pytest.raises(ConfigurationError, match="deleted and created again"):
        restore._source_topic_ids(None, _pipeline(), same, "file:///sp", False)


def test_a_savepoint_of_a_task_whose_offsets_vanished_is_refused(tmp_path: Path) -> None:
    """The job is stopped and its group's offsets vanish (expired, or a source topic created
    again: Kafka deletes the group's offsets of a deleted topic). A task that committed a
    checkpoint then has no offsets, and the export used to leave it out: the restore
    started it with empty state, silently. A task that never committed is left out as
    before (it starts like a new one)."""
    from snapline.pipeline.checkpoint.metadata import CheckpointRef, mark_committed
    from snapline.pipeline.savepoint.export import _check_offsets_not_lost

    storage = CheckpointStorage(str(tmp_path / "chk"))
    never = CheckpointRef(3, "aaaa0000")
    storage.write_bytes(f"{never.directory('job', 'p0')}/_metadata", b"{}")
    _check_offsets_not_lost(storage, "job", "p0")  # stored, never committed: a fresh start
    _check_offsets_not_lost(storage, "job", "p1")  # nothing stored
    committed = CheckpointRef(4, "bbbb1111")
    storage.write_bytes(f"{committed.directory('job', 'p0')}/_metadata", b"{}")
    mark_committed(storage, "job", "p0", committed)
    with pytest.raises(CheckpointError, match="task p0 committed checkpoint 4, but the consumer"):
        _check_offsets_not_lost(storage, "job", "p0")
