"""The topic rule (snapline/pipeline/runtime/topics.py) applied to what a cluster has: which
topics are created, with how many partitions, and which absences stop the worker."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import ConfigEntry

from snapline import KafkaSink, KafkaSource, Pipeline
from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.runtime.topics import (
    BATCH_OVERHEAD,
    KafkaUnavailableError,
    Role,
    TopicManager,
    TopicSpec,
    keep_internal_records,
    pipeline_topics,
    plan,
    producer_size_limits,
)

WHERE = "kafka:9092"


def readme_pipeline(**kwargs: object) -> Pipeline:
    pipeline = Pipeline("orders", **kwargs)  # type: ignore[arg-type]
    (pipeline.source(KafkaSource("orders")).key_by().sink(KafkaSink("customer-totals")))
    return pipeline


def test_repartition_topics_are_internal_and_created_like_the_sources_or_as_declared() -> None:
    pipeline = Pipeline("orders")
    keyed = pipeline.source(KafkaSource("orders")).key_by(lambda o: o["customer"])
    keyed.key_by(lambda o: o["region"], name="by-region", partitions=12).sink(KafkaSink("out"))
    specs = pipeline_topics(pipeline)
    internal = [(s.name, s.partitions) for s in specs if s.role is Role.INTERNAL]
    assert internal == [("orders.key_by-1.repartition", None), ("orders.by-region.repartition", 12)]
    result = plan(specs, {"orders": 4}, WHERE)
    assert result.create["orders.key_by-1.repartition"] == 4
    assert result.create["orders.by-region.repartition"] == 12


def test_a_repartition_topic_gets_no_more_partitions_than_key_groups() -> None:
    """32 source partitions and max_parallelism=16 made a 32-partition repartition topic:
    half its tasks owned no key-group, and export, restore and the Spark run refused the
    job's savepoints. Its default is capped; an output topic's is not."""
    pipeline = Pipeline("orders", max_parallelism=16)
    pipeline.source(KafkaSource("orders")).key_by(lambda o: o["customer"]).sink(KafkaSink("out"))
    result = plan(pipeline_topics(pipeline), {"orders": 32}, WHERE)
    assert result.create["orders.key_by-1.repartition"] == 16
    assert result.create["out"] == 32


def test_an_existing_repartition_topic_with_other_partitions_is_refused() -> None:
    pipeline = Pipeline("orders")
    keyed = pipeline.source(KafkaSource("orders")).key_by(lambda o: o["c"], partitions=8)
    keyed.sink(KafkaSink("out"))
    with pytest.raises(ConfigurationError, match="has 4 partitions .* partitions=8 is declared"):
        plan(pipeline_topics(pipeline), {"orders": 4, "orders.key_by-1.repartition": 4}, WHERE)


def test_roles_of_a_pipelines_topics() -> None:
    specs = pipeline_topics(readme_pipeline())
    assert [(s.name, s.role, s.partitions) for s in specs] == [
        ("orders", Role.SOURCE, None),
        ("customer-totals", Role.OUTPUT, None),
        ("orders.dead-letter", Role.DEAD_LETTER, 1),
    ]


def test_no_dead_letter_topic_when_errors_fail_the_job() -> None:
    specs = pipeline_topics(readme_pipeline(on_error="fail"))
    assert [s.role for s in specs] == [Role.SOURCE, Role.OUTPUT]


def test_missing_output_topic_is_created_like_the_sources() -> None:
    result = plan(pipeline_topics(readme_pipeline()), {"orders": 6}, WHERE)
    assert result.create == {"customer-totals": 6, "orders.dead-letter": 1}
    assert result.partitions == {"orders": 6, "customer-totals": 6, "orders.dead-letter": 1}


def test_create_partitions_wins_for_a_missing_topic_only() -> None:
    specs = [
        TopicSpec("in", Role.SOURCE),
        TopicSpec("out", Role.OUTPUT, 3),
        TopicSpec("kept", Role.OUTPUT, 3),
    ]
    result = plan(specs, {"in": 8, "kept": 1}, WHERE)
    assert result.create == {"out": 3}  # an existing topic is never altered
    assert result.partitions == {"in": 8, "out": 3, "kept": 1}


def test_existing_topics_are_not_created() -> None:
    assert (
        plan(
            pipeline_topics(readme_pipeline()),
            {"orders": 2, "customer-totals": 4, "orders.dead-letter": 1},
            WHERE,
        ).create
        == {}
    )


def test_missing_source_topic_is_an_error_naming_the_fix() -> None:
    with pytest.raises(ConfigurationError) as err:
        plan(pipeline_topics(readme_pipeline()), {}, WHERE)
    message = str(err.value)
    assert "['orders']" in message and WHERE in message
    assert "create_partitions=N to the KafkaSource" in message
    assert "customer-totals" not in message  # outputs are not the problem


def test_missing_source_with_create_partitions_is_created_and_sets_the_default() -> None:
    specs = [TopicSpec("in", Role.SOURCE, 5), TopicSpec("out", Role.OUTPUT)]
    assert plan(specs, {}, WHERE).create == {"in": 5, "out": 5}


def test_internal_topics_get_the_source_partitions() -> None:
    specs = [TopicSpec("in", Role.SOURCE), TopicSpec("job.repartition-1", Role.INTERNAL)]
    assert plan(specs, {"in": 12}, WHERE).create == {"job.repartition-1": 12}


def test_sources_must_be_co_partitioned() -> None:
    specs = [TopicSpec("a", Role.SOURCE), TopicSpec("b", Role.SOURCE, 4)]
    with pytest.raises(ConfigurationError, match="not co-partitioned"):
        plan(specs, {"a": 2}, WHERE)


def test_a_topic_read_and_written_keeps_its_source_role() -> None:
    for specs in (
        [TopicSpec("loop", Role.SOURCE), TopicSpec("loop", Role.OUTPUT)],
        [TopicSpec("loop", Role.OUTPUT), TopicSpec("loop", Role.SOURCE)],
    ):
        with pytest.raises(ConfigurationError, match="source topics"):
            plan(specs, {}, WHERE)


def test_bad_names_and_partition_counts_fail_before_anything_is_created() -> None:
    with pytest.raises(ConfigurationError, match="not a valid Kafka topic name"):
        plan([TopicSpec("in", Role.SOURCE), TopicSpec("bad name", Role.OUTPUT)], {"in": 1}, WHERE)
    with pytest.raises(ConfigurationError, match="create_partitions=0"):
        plan([TopicSpec("in", Role.SOURCE), TopicSpec("o", Role.OUTPUT, 0)], {"in": 1}, WHERE)


def test_unreachable_cluster_is_not_a_configuration_error() -> None:
    # Nothing listens on port 1: the broker may be down for a while, so the worker exits
    # with "restart me" (75) rather than "fix your configuration" (78).
    manager = TopicManager({"bootstrap.servers": "127.0.0.1:1", "log_level": 0}, "here", 1.0)
    with pytest.raises(KafkaUnavailableError, match="cannot reach Kafka at here") as err:
        manager.ensure([TopicSpec("in", Role.SOURCE)])
    assert not isinstance(err.value, ConfigurationError)


@pytest.mark.parametrize(
    ("setting", "named"),
    [({"foo.bar": "1"}, '"foo.bar"'), ({"security.protocol": "bogus"}, '"bogus"')],
)
def test_invalid_kafka_setting_is_a_configuration_error(
    setting: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigurationError, match="invalid Kafka settings") as err:
        TopicManager({"bootstrap.servers": "127.0.0.1:1", **setting}, "here")
    assert named in str(err.value) and "kafka_config" in str(err.value)


def test_a_topic_with_a_smaller_record_limit_lowers_the_producers_limits() -> None:
    """The broker refuses a whole batch over the topic's max.message.bytes, and the epoch's
    commit then fails on every retry: the producer's batch and record limits must stay below
    it. Left at librdkafka's defaults, they are lowered; the broker's default topic limit
    (1,048,588) changes nothing."""
    assert producer_size_limits({}, "out", 1_048_588) == {}
    cap = 65_536 - BATCH_OVERHEAD
    assert producer_size_limits({}, "out", 65_536) == {"message.max.bytes": cap, "batch.size": cap}
    assert producer_size_limits({"batch.size": 16_384}, "out", 65_536) == {"message.max.bytes": cap}


def test_a_producer_limit_set_above_a_topics_limit_fails_at_start_with_the_fix() -> None:
    with pytest.raises(ConfigurationError) as info:
        producer_size_limits({"message.max.bytes": 2_000_000}, "out", 1_048_588)
    message = str(info.value)
    assert "message.max.bytes=2000000" in message and "'out'" in message
    assert f"at most {1_048_588 - BATCH_OVERHEAD}" in message and "raise the topic" in message
    with pytest.raises(ConfigurationError, match="raise the topic's max.message.bytes"):
        producer_size_limits({}, "tiny", 1_000)


def test_a_repartition_topic_name_is_read_as_every_other_jobs_it_may_be() -> None:
    """``<job>.<name>.repartition`` is ambiguous when the job or the key_by name has a '.'."""
    from snapline.pipeline.runtime.topics import repartition_namesakes

    topic = "orders.eu.by-customer.repartition"
    assert repartition_namesakes("orders", topic) == ["orders.eu"]
    assert repartition_namesakes("orders.eu", topic) == ["orders"]
    assert repartition_namesakes("orders", "orders.by-customer.repartition") == []
    assert repartition_namesakes("a", "a.b.c.repartition") == ["a.b"]
    assert repartition_namesakes("a", "a.dead-letter") == []


class _RefusingAdmin:
    """An admin whose config changes an ACL refuses, describing ``policies`` (pure logic:
    what ``keep_internal_records`` decides from the answers; a real broker's side is in
    integration_tests/test_savepoint_kafka.py)."""

    def __init__(self, policies: dict[str, str], describe_fails: bool = False) -> None:
        self.policies = policies
        self.describe_fails = describe_fails

    def incremental_alter_configs(self, resources: list[Any], **_: Any) -> dict[Any, Future[Any]]:
        raise KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))

    def describe_configs(self, resources: list[Any], **_: Any) -> dict[Any, Future[Any]]:
        if self.describe_fails:
            raise KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
        answers: dict[Any, Future[Any]] = {}
        for resource in resources:
            future: Future[Any] = Future()
            policy = self.policies[resource.name]
            future.set_result({"cleanup.policy": ConfigEntry("cleanup.policy", policy)})
            answers[resource] = future
        return answers


@pytest.mark.parametrize("policy", ["compact", "compact,delete"])
def test_a_compacted_repartition_topic_that_cannot_be_changed_is_refused_naming_the_fix(
    policy: str,
) -> None:
    admin = _RefusingAdmin({"j.a.repartition": "delete", "j.b.repartition": policy})
    with pytest.raises(ConfigurationError) as refused:
        keep_internal_records(admin, ["j.a.repartition", "j.b.repartition"], 1.0)
    assert "j.b.repartition" in str(refused.value) and "j.a.repartition" not in str(refused.value)
    assert "--add-config cleanup.policy=delete" in str(refused.value)


def test_a_refused_change_on_topics_that_delete_or_cannot_be_read_is_logged_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    keep_internal_records(_RefusingAdmin({"j.a.repartition": "delete"}), ["j.a.repartition"], 1.0)
    keep_internal_records(_RefusingAdmin({}, describe_fails=True), ["j.a.repartition"], 1.0)
    assert "not checked" in caplog.text
    keep_internal_records(_RefusingAdmin({}), [], 1.0)  # no internal topic: nothing asked
