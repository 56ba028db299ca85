"""A repartition topic's name is never used again: a savepoint restore that must lower a
stage's partition count replaces the topic by one of its next generation
(``<job>.<name>.g<n>.repartition``), and every worker compiles its stages with the job's
generations from checkpoint storage. Pure logic; the restore on a real broker is in
integration_tests/test_recovery_deletes_only_dead.py and test_savepoints.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapline.connectors import KafkaSource
from snapline.pipeline import Pipeline
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError
from snapline.pipeline.savepoint.markers import (
    REPARTITION_TOPICS,
    read_topic_generations,
    use_topic_generations,
    write_topic_generations,
)
from snapline.pipeline.stages import repartition_topic
from snapline.sinks import KafkaSink


def _pipeline() -> Pipeline:
    pipeline = Pipeline("orders")
    (
        pipeline.source(KafkaSource("in", value_format="json"))
        .key_by(lambda v: v["customer"], name="by-customer")
        .map(lambda v: v)
        .key_by(lambda v: v["region"], name="by-region")
        .map(lambda v: v)
        .sink(KafkaSink("out", value_format="json"))
    )
    return pipeline


def test_generation_0_keeps_the_name_jobs_have_and_later_ones_are_new() -> None:
    assert repartition_topic("orders", "by-customer") == "orders.by-customer.repartition"
    names = {repartition_topic("orders", "by-customer", g) for g in range(5)}
    assert len(names) == 5 and "orders.by-customer.g3.repartition" in names


def test_stages_use_the_jobs_generations(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    pipeline = _pipeline()
    use_topic_generations(pipeline, storage)  # none stored: every topic of generation 0
    assert sorted(pipeline.repartition_topics()) == [
        "orders.by-customer.repartition",
        "orders.by-region.repartition",
    ]
    write_topic_generations(storage, "orders", {"by-customer": 2})
    fresh = _pipeline()  # as a worker that starts: the code alone does not know
    use_topic_generations(fresh, storage)
    assert sorted(fresh.repartition_topics()) == [
        "orders.by-customer.g2.repartition",
        "orders.by-region.repartition",
    ]
    assert read_topic_generations(storage, "other-job") == {}


def test_a_corrupt_generations_file_is_refused(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    write_topic_generations(storage, "orders", {"by-customer": 1})
    path = tmp_path / "orders" / REPARTITION_TOPICS
    path.write_bytes(path.read_bytes().replace(b'"by-customer":1', b'"by-customer":0'))
    with pytest.raises(CheckpointError, match="checksum"):
        read_topic_generations(storage, "orders")


def test_a_savepoint_records_the_generations_and_older_ones_have_none(tmp_path: Path) -> None:
    """A restore into another checkpoint storage (none stored there) goes on from the
    savepoint's generations, never back to a name the job used."""
    import orjson

    from snapline.pipeline.checkpoint.storage import crc32_checksum
    from snapline.pipeline.savepoint.format import SavepointMetadata, read_metadata

    storage = CheckpointStorage(str(tmp_path / "sp"))
    meta = SavepointMetadata(
        "orders", "0.1.0", 128, {"in": {0: 5}}, {"in": 1}, [], [], topic_generations={"x": 3}
    )
    storage.write_bytes("_savepoint.json", meta.encode())
    assert read_metadata(storage).topic_generations == {"x": 3}
    body = orjson.loads(meta.encode())["body"]
    del body["topic_generations"]  # as written before the field existed
    raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)
    older = orjson.dumps({"body": orjson.Fragment(raw), "checksum": crc32_checksum(raw)})
    assert SavepointMetadata.decode(older, "old").topic_generations == {}


def test_a_restore_goes_on_above_the_generations_whose_topics_exist() -> None:
    """A savepoint taken before a replacement, restored into another checkpoint storage on the
    same cluster: neither storage nor savepoint knows the later generation, the cluster does."""
    from types import SimpleNamespace

    from snapline.pipeline.savepoint.restore import _generations_in_kafka

    topics = [
        "orders.by-customer.g2.repartition",
        "orders.by-customer.g1.repartition",
        "orders.by-region.repartition",
        "orders.by-customer.gx.repartition",  # not a generation
        "other.by-customer.g7.repartition",  # another job's
        "in",
    ]
    admin = SimpleNamespace(
        list_topics=lambda timeout: SimpleNamespace(topics=dict.fromkeys(topics))
    )
    assert _generations_in_kafka(admin, _pipeline()) == {"by-customer": 2}  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["g1", "by-customer.g2", "a.b.g10"])
def test_a_key_by_name_that_ends_like_a_generation_is_refused(name: str) -> None:
    """``orders.x.g1.repartition`` would be both key_by "x"'s first replacement and key_by
    "x.g1"'s topic: the restore would empty (and its floor from Kafka would take) the other
    stage's topic."""
    from snapline.pipeline.errors import ConfigurationError

    pipeline = Pipeline("orders")
    (
        pipeline.source(KafkaSource("in", value_format="json"))
        .key_by(lambda v: v["customer"], name=name)
        .map(lambda v: v)
        .sink(KafkaSink("out", value_format="json"))
    )
    with pytest.raises(ConfigurationError, match="kept for the topics a savepoint restore"):
        pipeline.stages()


@pytest.mark.parametrize("name", ["g", "gx", "big1", "g1x", "g1.customers"])
def test_other_names_are_fine(name: str) -> None:
    pipeline = Pipeline("orders")
    (
        pipeline.source(KafkaSource("in", value_format="json"))
        .key_by(lambda v: v["customer"], name=name)
        .map(lambda v: v)
        .sink(KafkaSink("out", value_format="json"))
    )
    assert pipeline.repartition_topics() == [f"orders.{name}.repartition"]
