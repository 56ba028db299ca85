"""The refusal of a stage whose input topics have different partition counts names the fix
that applies: altering a source topic, or a savepoint restore for a repartition topic."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from snapline.pipeline.runtime.kafka_calls import KafkaClientError
from snapline.pipeline.runtime.worker import Worker


def _worker(stage_of_topic: dict[str, int], repartitioned: set[str]) -> Worker:
    worker = object.__new__(Worker)  # no broker: only what _check_co_partitioned reads
    worker._stage_of_topic = stage_of_topic
    worker._repartitioned = repartitioned
    return worker


def _described(**counts: int) -> dict[str, SimpleNamespace]:
    return {t: SimpleNamespace(partitions=list(range(n))) for t, n in counts.items()}


def test_source_topics_of_different_counts_are_refused_naming_alter() -> None:
    worker = _worker({"a": 0, "b": 0}, set())
    with pytest.raises(KafkaClientError, match="kafka-topics.sh --alter") as info:
        worker._check_co_partitioned({}, _described(a=2, b=3))
    assert "a: 2, b: 3" in str(info.value)
    assert "savepoint" not in str(info.value)


def test_a_repartition_topic_read_with_a_source_topic_names_a_savepoint_restore() -> None:
    worker = _worker({"src": 1, "job.by-x.repartition": 1}, {"job.by-x.repartition"})
    with pytest.raises(KafkaClientError, match="take a savepoint and restore it") as info:
        worker._check_co_partitioned({}, _described(src=4, **{"job.by-x.repartition": 2}))
    assert "kafka-topics.sh --alter" not in str(info.value)


def test_equal_counts_pass() -> None:
    worker = _worker({"a": 0, "b": 0}, set())
    worker._check_co_partitioned({}, _described(a=3, b=3))
