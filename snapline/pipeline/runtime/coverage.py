"""Partitions the job's consumer group assigned to nobody (KAFKA-13435).

A worker restarted within the session timeout rejoins the group as the same static member
and gets its old assignment back, without a rebalance. When that worker was the group's
leader and partitions were added to a topic the job reads while it was away, the group keeps
the assignment computed before: the new partitions belong to nobody, and nothing reads them
until something else rebalances the group (seen with librdkafka on Kafka 4.2: a leader
restarted after partitions were added; the other members' metadata checks do not rebalance,
only the leader's do). A rejoin of the leader does: the coordinator rebalances the group
when its leader joins again; another member's rejoin changes nothing.

So once after each assignment, when the worker has committed a checkpoint under it (the
cluster answers), it compares the members' assignments with the partitions of the topics
the job reads. A partition of a stable group that no member holds makes the worker subscribe
again (``Worker._check_coverage``): the leader's rejoin rebalances the group, and the others'
only restore their tasks once more.

Kafka calls: ListGroups first, then DescribeGroups of the job's group only if a broker listed
it (a describe looks the coordinator up and can abort the process when it times out while
the cluster comes up: ``kafka_calls.listed_groups``), and the topics' metadata.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import ConsumerGroupState
from confluent_kafka.admin import AdminClient

from snapline.pipeline.runtime.kafka_calls import listed_groups

#: Seconds each Kafka call of the check may take.
CALL_TIMEOUT = 10.0


def unassigned_partitions(
    kafka_config: dict[str, Any], group: str, topics: list[str], timeout: float = CALL_TIMEOUT
) -> list[tuple[str, int]] | None:
    """The partitions of ``topics`` no member of ``group`` holds, or None when the group is
    not stable or not listed (a rebalance on its way assigns them, or nothing can be said).
    Raises when Kafka does not answer."""
    admin = AdminClient(kafka_config)
    if not listed_groups(admin, timeout, [group]).get(group):
        return None
    future = admin.describe_consumer_groups([group], request_timeout=timeout)[group]
    description = future.result(timeout=timeout + 5)
    if description.state != ConsumerGroupState.STABLE or not description.members:
        return None
    held = {
        (tp.topic, tp.partition)
        for member in description.members
        if member.assignment is not None
        for tp in member.assignment.topic_partitions
    }
    metadata = admin.list_topics(timeout=timeout)
    missing: list[tuple[str, int]] = []
    for topic in topics:
        meta = metadata.topics.get(topic)
        if meta is None or meta.error is not None:
            continue
        missing.extend((topic, p) for p in sorted(meta.partitions) if (topic, p) not in held)
    return missing
