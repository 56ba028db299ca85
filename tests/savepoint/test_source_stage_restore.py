"""Source-stage state (a ``key_by()`` on the Kafka key keeps the stage) is per source
partition and goes only to a task the savepoint has offsets for. When the code reads other
source topics (``orders`` mirrored to ``src.orders`` by MirrorMaker 2), the savepoint has no
offsets there: its source-stage state is refused naming it, as state without a place is,
unless ``--allow-non-restored-state`` drops it on purpose; before, every source-stage task
was skipped and started empty, silently. Keyed-stage state (placed by key-group) is restored
either way. Pure logic: the restore's Kafka steps are replaced; a restore on a real broker is
in integration_tests/test_savepoint_kafka.py."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from snapline import (
    ConfigurationError,
    Context,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    Pipeline,
    ValueState,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.savepoint import restore
from snapline.pipeline.savepoint.format import (
    METADATA_FILE,
    OperatorState,
    SavepointFile,
    SavepointMetadata,
)
from snapline.pipeline.savepoint.restore import match_states
from snapline.pipeline.state.compat import state_description

PARTITIONS = 3


class Dedup(KeyedProcessFunction):
    seen = ValueState("seen", default=False)

    def process(self, value: Any, ctx: Context) -> None:
        if not self.seen.value():
            self.seen.update(True)
            ctx.output(value)


def source_stage_job(topic: str) -> Pipeline:
    """The dedup keyed by the Kafka key: no repartition, it stays in the source stage."""
    p = Pipeline("job")
    p.source(KafkaSource(topic)).key_by().process(Dedup(), uid="dedup").sink(KafkaSink("out"))
    return p


def keyed_stage_job(topic: str) -> Pipeline:
    """The dedup behind a re-keying key_by: a keyed stage, placed by key-group."""
    p = Pipeline("job")
    stream = p.source(KafkaSource(topic, value_format="json")).key_by(lambda v: v["k"], name="by-k")
    stream.process(Dedup(), uid="dedup").sink(KafkaSink("out"))
    return p


def savepoint_of(p: Pipeline, topic: str = "orders") -> SavepointMetadata:
    """A savepoint of ``p`` reading ``topic``: offsets for its partitions and one state file
    per task, as the export writes them (``p00001`` in the source stage, a key-group range
    in a keyed stage)."""
    keyed = bool(p.stages().repartitions)
    files = [
        SavepointFile(
            f"operators/dedup/kg-{i * 42:05d}-{i * 42 + 41:05d}.parquet"
            if keyed
            else f"operators/dedup/p{i:05d}.parquet",
            rows=5,
            size=100,
            checksum="0",
            key_groups=(i * 42, i * 42 + 41) if keyed else None,
            partition=i,
        )
        for i in range(PARTITIONS)
    ]
    states = [
        state_description(d.describe()) for entries in p.state_ids().values() for _, d in entries
    ]
    operator = OperatorState("dedup", "keyed" if keyed else "source", states, files)
    return SavepointMetadata(
        "job",
        "0.1.0",
        p.max_parallelism,
        {topic: {i: 10 + i for i in range(PARTITIONS)}},
        {topic: PARTITIONS},
        [operator],
        [],
    )


def partitions_of(p: Pipeline) -> dict[str, int]:
    out = dict.fromkeys(p.source_topics(), PARTITIONS)
    out.update({rep.topic: PARTITIONS for rep in p.stages().repartitions.values()})
    return out


def test_source_stage_state_of_a_renamed_topic_is_refused_naming_it() -> None:
    saved = savepoint_of(source_stage_job("orders"))
    now = source_stage_job("src.orders")
    mapping = match_states(now, saved, allow_non_restored=False)  # uid and state match
    assert ("dedup", "seen") in mapping
    with pytest.raises(ConfigurationError) as caught:
        restore.seeded_tasks(now, saved, mapping, partitions_of(now), allow_non_restored=False)
    message = str(caught.value)
    assert "'seen'" in message and "'dedup'" in message
    assert "partitions 0, 1, 2" in message
    assert "reads now (src.orders)" in message and "are of orders" in message
    assert "--allow-non-restored-state" in message


def test_allow_non_restored_state_drops_it_on_purpose_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    saved = savepoint_of(source_stage_job("orders"))
    now = source_stage_job("src.orders")
    mapping = match_states(now, saved, allow_non_restored=True)
    with caplog.at_level(logging.WARNING, logger=restore.__name__):
        chosen = restore.seeded_tasks(
            now, saved, mapping, partitions_of(now), allow_non_restored=True
        )
    assert chosen == []  # the tasks start empty at the source's starting position
    assert "dropping source-stage states '__timers__', 'seen' of operator 'dedup'" in caplog.text


def test_the_same_topics_restore_the_source_stage_state_at_the_savepoints_offsets() -> None:
    p = source_stage_job("orders")
    saved = savepoint_of(p)
    mapping = match_states(p, saved, allow_non_restored=False)
    chosen = restore.seeded_tasks(p, saved, mapping, partitions_of(p), allow_non_restored=False)
    assert [(t.task_id, positions) for t, positions in chosen] == [
        (f"p{i}", {("orders", i): 10 + i}) for i in range(PARTITIONS)
    ]


def test_fewer_source_partitions_refuse_the_state_of_the_partitions_gone() -> None:
    saved = savepoint_of(source_stage_job("orders"))
    now = source_stage_job("src.orders")
    # A savepoint that also read the new topic, which has fewer partitions than the old one.
    saved = SavepointMetadata(
        "job",
        "0.1.0",
        saved.max_parallelism,
        {**saved.source_offsets, "src.orders": {0: 1, 1: 1}},
        {**saved.source_partitions, "src.orders": 2},
        saved.operators,
        [],
    )
    mapping = match_states(now, saved, allow_non_restored=False)
    with pytest.raises(ConfigurationError, match="for source partitions 2,"):
        restore.seeded_tasks(now, saved, mapping, {"src.orders": 2}, allow_non_restored=False)


def test_keyed_stage_state_is_restored_when_the_source_topic_is_renamed() -> None:
    saved = savepoint_of(keyed_stage_job("orders"))
    now = keyed_stage_job("src.orders")
    mapping = match_states(now, saved, allow_non_restored=False)
    chosen = restore.seeded_tasks(now, saved, mapping, partitions_of(now), allow_non_restored=False)
    assert sorted(t.task_id for t, _ in chosen) == [f"s1-p{i}" for i in range(PARTITIONS)]


class _Stop(Exception):
    """Raised in place of loading the state: the plan was made."""


def _seed_until_loading(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pipeline: Pipeline, saved: SavepointMetadata
) -> list[Any]:
    """Run the restore (``_seed``) without Kafka up to the loading of the state; returns the
    load jobs it planned, or raises what it refused with."""
    sp = tmp_path / "sp"
    CheckpointStorage(str(sp)).write_bytes(METADATA_FILE, saved.encode())
    planned: list[Any] = []

    def run_jobs(fn: Any, jobs: list[Any], *args: Any) -> list[Any]:
        planned.extend(jobs)
        raise _Stop

    class Topics:
        def __init__(self, *args: Any) -> None:
            pass

        def ensure(self, specs: Any) -> Any:
            return SimpleNamespace(partitions=dict.fromkeys(pipeline.source_topics(), PARTITIONS))

    monkeypatch.setattr(restore, "AdminClient", lambda config: object())
    monkeypatch.setattr(restore, "wait_until_stopped", lambda admin, job: 0)
    monkeypatch.setattr(restore, "check_repartition_owners", lambda config, p: None)
    monkeypatch.setattr(restore, "TopicManager", Topics)
    monkeypatch.setattr(restore, "_source_topic_ids", lambda *args: {})
    monkeypatch.setattr(restore, "run_jobs", run_jobs)
    with pytest.raises(_Stop):
        restore._seed(
            pipeline,
            {"bootstrap.servers": "127.0.0.1:1"},
            str(tmp_path / "checkpoints"),
            str(sp),
            False,
            None,
            CheckpointStorage(str(tmp_path / "flight")),
            restore.RestoreLock({}, pipeline.name),
            False,
        )
    return planned


def test_the_restore_refuses_before_it_loads_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The reviewer's case end to end through the restore: before the fix it planned no
    task (the dedup's state silently gone) and went on to change Kafka."""
    saved = savepoint_of(source_stage_job("orders"))
    with pytest.raises(
        ConfigurationError, match="source-stage states '__timers__', 'seen' of operator 'dedup'"
    ):
        _seed_until_loading(monkeypatch, tmp_path, source_stage_job("src.orders"), saved)


def test_the_restore_loads_the_dedup_state_for_every_task_with_the_same_topics(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    saved = savepoint_of(source_stage_job("orders"))
    jobs = _seed_until_loading(monkeypatch, tmp_path, source_stage_job("orders"), saved)
    assert [(j.partition, [op.uid for op in j.operators]) for j in jobs] == [
        (i, ["dedup"]) for i in range(PARTITIONS)
    ]
