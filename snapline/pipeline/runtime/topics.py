"""The one owner of a job's Kafka topics: which must exist, which Snapline creates, and how.

The rule (also in the README, "Writing a pipeline", and the KafkaSource/KafkaSink docstrings):

- **Source topics** belong to whoever writes them. A missing one stops the worker at start
  with a ConfigurationError naming the topic and the fix, unless its KafkaSource has
  ``create_partitions=N``, which creates it with N partitions.
- **Output topics** (KafkaSink) are created when missing: with the sink's
  ``create_partitions``, else with as many partitions as the source topics (keyed output then
  stays partitioned like the input and the state).
- **Topics Snapline owns** are created when missing: the dead-letter topic (1 partition; only
  when ``on_error="dead_letter"``, the default) and internal topics (``Role.INTERNAL``, e.g.
  repartition topics: as many partitions as the source topics).
- Existing topics are used as they are, never altered; the source topics of a pipeline must
  have the same number of partitions. New topics get the cluster's default replication factor
  and topic settings (``default.replication.factor`` and the broker's topic defaults).

``plan`` applies the rule to what the cluster has (pure, unit-tested); ``TopicManager`` asks
the cluster and creates what the plan says. Threads: the worker's main thread, at start.
"""

from __future__ import annotations

import enum
import logging
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from snapline.pipeline.errors import ConfigurationError, SnaplineError
from snapline.pipeline.graph import Pipeline
from snapline.pipeline.runtime.kafka_calls import kafka_error, listed_groups

log = logging.getLogger(__name__)

#: Kafka's own limits on topic names (kafka.common.internals.Topic).
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
#: Use the cluster's default.replication.factor / num.partitions (Kafka 2.4+, KIP-464).
BROKER_DEFAULT = -1
DEAD_LETTER_PARTITIONS = 1
#: Internal (repartition) topics keep records until the job's consumers are past them: no
#: time-based retention (the worker deletes consumed records, DeleteRecords), and small
#: segments so that deleted records free their disk space soon (as Kafka Streams does).
#: Any event time crosses a repartition topic (its records carry the event time as their
#: Kafka timestamp): Kafka 4 refuses timestamps more than an hour ahead of the broker's clock
#: by default, and a single such record failed every checkpoint of the job that read it.
#: Brokers before 3.6 do not know these settings; topics are then created without them.
EVENT_TIME_CONFIG = {
    "message.timestamp.before.max.ms": str((1 << 63) - 1),
    "message.timestamp.after.max.ms": str((1 << 63) - 1),
}
#: What an internal topic keeps: everything, until the job deletes what it has read (a broker's
#: log.retention.bytes, or a retention.ms set by hand, would delete records between stages;
#: compaction, a topic created with ``cleanup.policy=compact`` by hand or by a broker's
#: default, would drop every record of a key but its newest before the next stage read it,
#: and refuses the job's and a restore's DeleteRecords).
KEEP_CONFIG = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}

INTERNAL_TOPIC_CONFIG = {
    **KEEP_CONFIG,
    "segment.bytes": str(64 * 1024 * 1024),
    "segment.ms": str(10 * 60 * 1000),
    **EVENT_TIME_CONFIG,
}


#: A job name (``Pipeline``'s rule), for the other readings of a repartition topic's name.
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,100}")
_REPARTITION_SUFFIX = ".repartition"


def repartition_namesakes(job: str, topic: str) -> list[str]:
    """The other jobs whose repartition topic ``topic`` may be: ``<job>.<name>.repartition``
    read at another '.' (job ``orders`` with ``key_by(name="eu.by-customer")`` and job
    ``orders.eu`` with ``key_by(name="by-customer")`` both have
    ``orders.eu.by-customer.repartition``)."""
    if not topic.endswith(_REPARTITION_SUFFIX):
        return []
    base = topic[: -len(_REPARTITION_SUFFIX)]
    return [
        base[:i]
        for i, char in enumerate(base)
        if char == "." and i != len(job) and _JOB_NAME.fullmatch(base[:i])
    ]


def check_repartition_owners(kafka_config: dict[str, Any], pipeline: Pipeline) -> None:
    """Refuse (ConfigurationError) a job whose repartition topic another job reads: that job's
    group has committed offsets in it. Each job would delete the records below its own
    positions, the other's unread ones included, and read the other's records; a savepoint
    restore of either would recreate the topic under the other."""
    topics = [rep.topic for rep in pipeline.stages().repartitions.values()]
    candidates = {t: repartition_namesakes(pipeline.name, t) for t in topics}
    groups = sorted({g for found in candidates.values() for g in found})
    if not groups:
        return
    admin = AdminClient(kafka_config)
    try:
        # Only groups that exist are asked for offsets (an offset fetch looks up the group's
        # coordinator, which can abort the process when it times out: listed_groups).
        existing = listed_groups(admin, 10, groups)
        groups = [g for g in groups if g in existing]
        offsets = {}
        for group in groups:  # one group per request (the client's limit)
            futures = admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group)], request_timeout=30
            )
            offsets[group] = futures[group].result(timeout=35)
    except Exception as exc:  # a courtesy check, as the transactional-id one
        log.warning(
            "could not check whether another job reads this job's repartition topics: %s", exc
        )
        return
    for topic, others in candidates.items():
        for other in others:
            if other in offsets and any(
                tp.topic == topic and tp.offset >= 0 for tp in offsets[other].topic_partitions
            ):
                raise ConfigurationError(
                    f"repartition topic {topic!r} of job {pipeline.name!r} is also job "
                    f"{other!r}'s (its consumer group has offsets in it): each would delete "
                    "and read the other's records. Rename a key_by (key_by(..., name=...)) or "
                    "a job so that neither reads as the other's name, '.' and a key_by name. "
                    f"If job {other!r} no longer reads it (renamed since), delete its offsets "
                    f"there: kafka-consumer-groups.sh --delete-offsets --group {other} "
                    f"--topic {topic} --bootstrap-server ..."
                )


def set_topic_configs(
    admin: Any, names: list[str], configs: Mapping[str, str], timeout: float
) -> Exception | None:
    """Set ``configs`` on topics ``names``; the error if the broker refused or timed out."""
    resources = [
        ConfigResource(
            ResourceType.TOPIC,
            name,
            incremental_configs=[
                ConfigEntry(key, value, incremental_operation=AlterConfigOpType.SET)
                for key, value in configs.items()
            ],
        )
        for name in names
    ]
    try:
        futures = admin.incremental_alter_configs(resources, request_timeout=timeout)
        for future in futures.values():
            future.result(timeout=timeout + 1)
    except (KafkaException, TimeoutError) as exc:
        return exc
    return None


def keep_internal_records(admin: Any, names: list[str], timeout: float) -> None:
    """Set KEEP_CONFIG on the internal topics ``names`` (they exist). Where the broker or an
    ACL refuses, a topic that compacts (``cleanup.policy`` with ``compact``: its records of a
    key but the newest dropped between stages) is refused (ConfigurationError, naming the
    fix); anything else is logged, as is a cluster that does not say."""
    if not names:
        return
    refused = set_topic_configs(admin, names, KEEP_CONFIG, timeout)
    if refused is None:
        return
    log.warning("cannot set %s on the repartition topics (%s)", KEEP_CONFIG, refused)
    try:
        futures = admin.describe_configs(
            [ConfigResource("topic", name) for name in names], request_timeout=timeout
        )
        policies = {
            resource.name: future.result(timeout=timeout + 1).get("cleanup.policy")
            for resource, future in futures.items()
        }
    except (KafkaException, TimeoutError) as exc:
        log.warning("cannot read the repartition topics' cleanup.policy (%s): not checked", exc)
        return
    compacted = sorted(
        name
        for name, entry in policies.items()
        if entry is not None and "compact" in (entry.value or "")
    )
    if compacted:
        raise ConfigurationError(
            f"repartition topic(s) {', '.join(compacted)} have cleanup.policy=compact: "
            "compaction drops every record of a key but its newest before the next stage "
            f"reads it, and the job could not set cleanup.policy=delete ({refused}). Set it: "
            f"kafka-configs.sh --bootstrap-server ... --alter --entity-type topics "
            f"--entity-name {compacted[0]} --add-config cleanup.policy=delete"
        )


def without_event_time_config(config: Mapping[str, str]) -> dict[str, str]:
    """``config`` for a broker that refused EVENT_TIME_CONFIG (INVALID_CONFIG: before 3.6)."""
    return {k: v for k, v in config.items() if k not in EVENT_TIME_CONFIG}


def refused_config(exc: KafkaException) -> bool:
    error = kafka_error(exc)
    return error is not None and error.code() == KafkaError.INVALID_CONFIG


#: How long a just-created topic may take to have a leader for every partition.
LEADER_WAIT = 30.0
#: librdkafka's defaults for ``message.max.bytes`` and ``batch.size``.
PRODUCER_DEFAULT_LIMIT = 1_000_000
#: Bytes a record batch holds besides its records' keys, values and headers, with room to
#: spare: Kafka's v2 batch header is 61 bytes and librdkafka's per-record check already
#: counts each record's own framing; lz4 sends a batch uncompressed when compressing would
#: not make it smaller.
BATCH_OVERHEAD = 256
#: How long the worker waits for the topics' max.message.bytes at start (then it goes on).
DESCRIBE_TIMEOUT = 5.0
#: librdkafka's smallest allowed ``message.max.bytes``.
_SMALLEST_PRODUCER_LIMIT = 1000

# Errors of a create request that say "the cluster is busy or unreachable": try again later
# (the worker exits and is restarted), as opposed to a request that can never succeed.
_TRANSIENT = {
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NOT_CONTROLLER,
    KafkaError.NETWORK_EXCEPTION,
    KafkaError.LEADER_NOT_AVAILABLE,
}


#: What Kafka answers for a topic without an id (brokers before 2.8, or a cluster that
#: never gave its topics ids): no recreation can be told from it.
NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"


def topic_id(description: Any) -> str:
    """The id of a described topic ("" when Kafka gives none)."""
    found = str(getattr(description, "topic_id", None) or "")
    return "" if found in (NO_TOPIC_ID, "None") else found


def ids_differ(old: str, new: str) -> bool:
    """Two ids of one topic name tell a recreation only when both are real ids."""
    return old not in ("", NO_TOPIC_ID) and new not in ("", NO_TOPIC_ID) and old != new


def recreated_since(saved: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """The topics of ``saved`` (name -> id when it was read) whose id ``now`` differs: each
    was deleted and created again since, and offsets of the old topic mean nothing in it."""
    return sorted(t for t, i in saved.items() if ids_differ(i, now.get(t, "")))


def cluster_id_of(admin: Any) -> str:
    """The Kafka cluster's id ("" when it cannot be read): topic ids are per cluster."""
    try:
        return str(admin.list_topics(timeout=10).cluster_id or "")
    except Exception as exc:
        log.info("reading the cluster id: %s", exc)
        return ""


def describe_topics(admin: Any, topics: Iterable[str], what: str) -> dict[str, Any]:
    """Topic name -> its description (id, partitions). Asked up to three times (a topic
    created a moment ago may not be known everywhere yet); a topic Kafka still does not
    describe is left out and logged (``what`` names the topics)."""
    from confluent_kafka import TopicCollection

    wanted = sorted(set(topics))
    found: dict[str, Any] = {}
    for attempt in range(3):
        missing = [t for t in wanted if t not in found]
        if not missing:
            break
        if attempt:
            time.sleep(1.0)
        try:
            futures = admin.describe_topics(TopicCollection(missing), request_timeout=10)
        except Exception as exc:
            log.info("describing the %s: %s", what, exc)
            continue
        for topic, future in futures.items():
            try:
                found[topic] = future.result(timeout=15)
            except Exception as exc:
                log.info("describing topic %s: %s", topic, exc)
    for topic in wanted:
        if topic not in found:
            log.warning("could not describe topic %s (%s)", topic, what)
    return found


def describe_topic_ids(admin: Any, topics: Iterable[str], what: str) -> dict[str, str]:
    """Topic name -> its id (a new id each time a topic is created): ``describe_topics``."""
    return {t: topic_id(d) for t, d in describe_topics(admin, topics, what).items()}


class KafkaUnavailableError(SnaplineError):
    """The cluster did not answer (or not in time): a later attempt may succeed. Not a
    ConfigurationError, so a supervised worker is restarted instead of stopping the job."""


class Role(enum.Enum):
    """Why the job uses a topic; the role decides whether a missing topic is created."""

    SOURCE = "source"
    OUTPUT = "output"
    DEAD_LETTER = "dead-letter"
    INTERNAL = "internal"


@dataclass(frozen=True)
class TopicSpec:
    """A topic the job needs. ``partitions``: for a missing topic, how many to create it
    with (None: the rule's default; for a source, None means "do not create")."""

    name: str
    role: Role
    partitions: int | None = None
    declared_by: str = ""
    #: The most partitions the rule's default may give it (a repartition topic: the job's
    #: max_parallelism, since a partition is a task owning at least one key-group).
    max_partitions: int | None = None


@dataclass(frozen=True)
class TopicPlan:
    """What to create (name -> partitions) and the partitions of every topic afterwards."""

    create: Mapping[str, int]
    partitions: Mapping[str, int]


def pipeline_topics(pipeline: Pipeline) -> list[TopicSpec]:
    """The topics ``pipeline`` reads and writes, each with its role."""
    specs = [
        TopicSpec(topic, Role.SOURCE, source.create_partitions, "KafkaSource")
        for source in pipeline.sources()
        for topic in source.topic_list
    ]
    specs += [
        TopicSpec(topic, Role.OUTPUT, partitions, f"{type(sink).__name__} {sink.name!r}")
        for sink in pipeline.sinks()
        for topic, partitions in sink.output_topics().items()
    ]
    specs += [
        TopicSpec(
            rep.topic,
            Role.INTERNAL,
            rep.partitions,
            f"key_by {rep.name!r}",
            max_partitions=pipeline.max_parallelism,
        )
        for rep in pipeline.stages().repartitions.values()
    ]
    if pipeline.on_error == "dead_letter":
        specs.append(
            TopicSpec(
                pipeline.dead_letter_topic,
                Role.DEAD_LETTER,
                DEAD_LETTER_PARTITIONS,
                "the pipeline's dead_letter_topic",
            )
        )
    return specs


def plan(specs: Iterable[TopicSpec], existing: Mapping[str, int], where: str) -> TopicPlan:
    """Apply the module's rule to ``specs`` given the ``existing`` topics (name ->
    partitions) of the cluster at ``where``. Raises ConfigurationError, before anything is
    created, when a source topic is missing or the sources are not co-partitioned."""
    by_name: dict[str, TopicSpec] = {}
    # A topic that is both read and written (or declared twice) keeps one role, the source
    # role first: a missing source is never created as if it were an output.
    for spec in sorted(specs, key=lambda s: s.role is not Role.SOURCE):
        by_name.setdefault(spec.name, spec)
    for spec in by_name.values():
        if spec.partitions is not None and (
            not isinstance(spec.partitions, int) or spec.partitions < 1
        ):
            raise ConfigurationError(
                f"{spec.declared_by or spec.role.value}: create_partitions="
                f"{spec.partitions!r} for topic {spec.name!r} must be an int >= 1"
            )
    sources = [s for s in by_name.values() if s.role is Role.SOURCE]
    missing = [s.name for s in sources if s.name not in existing and s.partitions is None]
    if missing:
        raise ConfigurationError(
            f"source topics {missing} do not exist on {where}. Snapline does not create the "
            "topics it reads: create them (e.g. kafka-topics.sh --create --topic NAME "
            "--partitions N), or pass create_partitions=N to the KafkaSource to have them "
            "created"
        )
    source_partitions = {s.name: existing.get(s.name) or int(s.partitions or 0) for s in sources}
    if len(set(source_partitions.values())) > 1:
        raise ConfigurationError(
            f"source topics are not co-partitioned (partitions per topic: "
            f"{source_partitions}); a pipeline's source topics need the same number of "
            "partitions and the same key"
        )
    default = next(iter(source_partitions.values()), 1)
    create: dict[str, int] = {}
    for spec in by_name.values():
        if spec.name in existing:
            if (
                spec.role is Role.INTERNAL
                and spec.partitions is not None
                and existing[spec.name] != spec.partitions
            ):
                raise ConfigurationError(
                    f"{spec.declared_by}: the internal topic {spec.name!r} has "
                    f"{existing[spec.name]} partitions on {where}, but partitions="
                    f"{spec.partitions} is declared. It holds records between stages, so "
                    "Snapline never recreates it: declare partitions="
                    f"{existing[spec.name]}, or run the changed pipeline under a new name"
                )
            continue
        if not _TOPIC_NAME.match(spec.name) or spec.name in (".", ".."):
            raise ConfigurationError(
                f"{spec.declared_by or spec.role.value}: {spec.name!r} is not a valid Kafka "
                "topic name (1-249 characters of letters, digits, '.', '_', '-')"
            )
        if spec.partitions is not None:
            create[spec.name] = spec.partitions
        elif spec.role is Role.DEAD_LETTER:
            create[spec.name] = DEAD_LETTER_PARTITIONS
        else:  # OUTPUT, INTERNAL: like the sources
            # A repartition topic of more partitions than key-groups made tasks that own
            # none, and savepoints (rescaling, upgrades) of the job impossible.
            create[spec.name] = min(default, spec.max_partitions or default)
    partitions = {name: existing[name] for name in by_name if name in existing}
    partitions.update(create)
    return TopicPlan(create=create, partitions=partitions)


def producer_size_limits(
    kafka_config: Mapping[str, Any], topic: str, topic_limit: int
) -> dict[str, int]:
    """The producer settings that keep every record batch it sends within ``topic_limit``,
    the smallest ``max.message.bytes`` of the topics the job writes (``topic``).

    The broker refuses a whole batch larger than the topic's limit, and the epoch's
    transaction then fails to commit, on every retry of the same input. A batch is at most
    ``batch.size`` bytes and a record at most ``message.max.bytes`` (librdkafka refuses a
    larger one in ``produce()``, and Snapline sends that record's input to the dead letters).
    So both must stay ``BATCH_OVERHEAD`` below the topic's limit: lowered when
    ``kafka_config`` leaves them at librdkafka's defaults; a ConfigurationError naming the fix
    when it sets one higher."""
    cap = topic_limit - BATCH_OVERHEAD
    if cap < _SMALLEST_PRODUCER_LIMIT:
        raise ConfigurationError(
            f"topic {topic!r} accepts record batches of at most {topic_limit} bytes "
            f"(max.message.bytes); Snapline needs at least "
            f"{_SMALLEST_PRODUCER_LIMIT + BATCH_OVERHEAD}: raise the topic's max.message.bytes"
        )
    settings: dict[str, int] = {}
    for name in ("message.max.bytes", "batch.size"):
        if name in kafka_config:
            if int(kafka_config[name]) > cap:
                raise ConfigurationError(
                    f"kafka_config sets {name}={kafka_config[name]}, but topic {topic!r} "
                    f"accepts record batches of at most {topic_limit} bytes "
                    f"(max.message.bytes): the broker would refuse a batch that size and "
                    f"every retry of the checkpoint would fail the same way. Set {name} to "
                    f"at most {cap}, or raise the topic's max.message.bytes"
                )
        elif cap < PRODUCER_DEFAULT_LIMIT:
            settings[name] = cap
    return settings


class TopicManager:
    """Checks and creates the job's topics on the cluster (see the module's rule)."""

    def __init__(self, kafka_config: Mapping[str, Any], where: str, timeout: float = 30.0) -> None:
        try:
            self._admin = AdminClient(dict(kafka_config))
        except KafkaException as exc:
            # The first Kafka client a worker creates: an unknown setting or a bad value
            # surfaces here, and no restart can fix it.
            error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else exc
            reason = error.str() if isinstance(error, KafkaError) else str(error)
            raise ConfigurationError(
                f"invalid Kafka settings: {reason}; fix or remove it in the pipeline's "
                "kafka_config (settings: librdkafka's CONFIGURATION.md)"
            ) from exc
        self._where = where
        self._timeout = timeout

    def existing(self) -> dict[str, int]:
        """Partitions per topic on the cluster."""
        try:
            metadata = self._admin.list_topics(timeout=self._timeout)
        except KafkaException as exc:
            raise KafkaUnavailableError(
                f"cannot reach Kafka at {self._where}: {exc}; check --bootstrap-servers and "
                "kafka_config (security settings), or wait until the broker is back"
            ) from exc
        # A topic in a transient error state (no leader yet) exists all the same.
        return {
            name: len(topic.partitions)
            for name, topic in metadata.topics.items()
            if topic.error is None or topic.error.code() != KafkaError.UNKNOWN_TOPIC_OR_PART
        }

    def ensure(self, specs: Iterable[TopicSpec]) -> TopicPlan:
        """Create what the rule says is missing and wait until it is usable."""
        specs = list(specs)
        result = plan(specs, self.existing(), self._where)
        if not result.create:
            return result
        internal = {s.name for s in specs if s.role is Role.INTERNAL}
        new = [
            NewTopic(
                name,
                num_partitions=n,
                replication_factor=BROKER_DEFAULT,
                config=INTERNAL_TOPIC_CONFIG if name in internal else {},
            )
            for name, n in result.create.items()
        ]
        futures = self._admin.create_topics(
            new, operation_timeout=self._timeout, request_timeout=self._timeout
        )
        retry = []
        for name, future in futures.items():
            try:
                future.result(timeout=self._timeout + 5)
                log.info("created topic %s (%d partitions)", name, result.create[name])
            except KafkaException as exc:
                if name in internal and refused_config(exc):
                    retry.append(name)
                    continue
                self._raise_create_error(name, result.create[name], exc)
        if retry:  # a broker before 3.6: the event-time settings do not exist there
            log.info(
                "the broker does not know %s: topics %s created without", EVENT_TIME_CONFIG, retry
            )
            futures = self._admin.create_topics(
                [
                    NewTopic(
                        name,
                        num_partitions=result.create[name],
                        replication_factor=BROKER_DEFAULT,
                        config=without_event_time_config(INTERNAL_TOPIC_CONFIG),
                    )
                    for name in retry
                ],
                operation_timeout=self._timeout,
                request_timeout=self._timeout,
            )
            for name, future in futures.items():
                try:
                    future.result(timeout=self._timeout + 5)
                except KafkaException as exc:
                    self._raise_create_error(name, result.create[name], exc)
        self._wait_for_leaders(result.create)
        return result

    def accept_any_event_time(self, specs: Iterable[TopicSpec]) -> None:
        """Set KEEP_CONFIG and EVENT_TIME_CONFIG on the job's internal topics that exist
        (created before they were part of their config, or changed by hand). Best effort: a
        broker or an ACL that refuses is logged (a record deleted there anyway stops the
        job: the worker checks its positions against the log), except on a compacted topic
        (``keep_internal_records``)."""
        names = sorted({s.name for s in specs if s.role is Role.INTERNAL})
        if not names:
            return
        keep_internal_records(self._admin, names, min(self._timeout, DESCRIBE_TIMEOUT))
        refused = self._set_configs(names, EVENT_TIME_CONFIG)
        if refused is None:
            return
        if isinstance(refused, KafkaException) and refused_config(refused):
            log.info("the broker does not know %s: nothing to set", sorted(EVENT_TIME_CONFIG))
            return
        log.warning(
            "cannot set %s on the repartition topics (%s): records with event times more "
            "than the broker's message.timestamp.after.max.ms ahead (1 h by default on "
            "Kafka 4) would fail the job's checkpoints",
            sorted(EVENT_TIME_CONFIG),
            refused,
        )

    def _set_configs(self, names: list[str], configs: Mapping[str, str]) -> Exception | None:
        """Set ``configs`` on topics ``names``; the error if the broker refused or timed out."""
        return set_topic_configs(self._admin, names, configs, min(self._timeout, DESCRIBE_TIMEOUT))

    def smallest_record_limit(self, specs: Iterable[TopicSpec]) -> tuple[str, int] | None:
        """The topic the job writes with the smallest ``max.message.bytes``, and that limit;
        None when the cluster does not say (e.g. DescribeConfigs is not allowed: logged)."""
        names = sorted({s.name for s in specs if s.role is not Role.SOURCE})
        if not names:
            return None
        # A check, not a requirement: bounded well below the topic calls' timeout, so that a
        # broker going away just now delays the start by seconds, not by a minute.
        timeout = min(self._timeout, DESCRIBE_TIMEOUT)
        try:
            futures = self._admin.describe_configs(
                [ConfigResource("topic", name) for name in names], request_timeout=timeout
            )
        except KafkaException as exc:
            log.warning("cannot read the topics' max.message.bytes (%s): not checked", exc)
            return None
        smallest: tuple[str, int] | None = None
        deadline = time.monotonic() + timeout + 1
        for resource, future in futures.items():
            try:
                left = max(deadline - time.monotonic(), 0.1)
                entry = future.result(timeout=left).get("max.message.bytes")
                limit = int(entry.value) if entry is not None and entry.value else None
            except (KafkaException, TimeoutError, ValueError) as exc:
                log.warning(
                    "cannot read max.message.bytes of topic %s (%s): the producer's record "
                    "size limits are not checked against it",
                    resource.name,
                    exc,
                )
                continue
            if limit is not None and (smallest is None or limit < smallest[1]):
                smallest = (resource.name, limit)
        return smallest

    def _raise_create_error(self, name: str, partitions: int, exc: KafkaException) -> None:
        error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        code = error.code() if error is not None else None
        if code == KafkaError.TOPIC_ALREADY_EXISTS:
            return  # another worker of the job created it first
        if code in _TRANSIENT:
            raise KafkaUnavailableError(f"creating topic {name} on {self._where}: {exc}") from exc
        if code in (
            KafkaError.TOPIC_AUTHORIZATION_FAILED,
            KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        ):
            raise ConfigurationError(
                f"not allowed to create topic {name!r} on {self._where} ({exc}): create it "
                f"yourself with {partitions} partitions, or grant this client CREATE on it"
            ) from exc
        raise ConfigurationError(
            f"cannot create topic {name!r} with {partitions} partitions on {self._where}: "
            f"{exc}; create it yourself, or fix the cluster setting the error names"
        ) from exc

    def _wait_for_leaders(self, created: Mapping[str, int]) -> None:
        """A just-created topic takes a moment to have a leader for every partition; producing
        or assigning before that only fails with retriable errors, but waiting here keeps the
        first checkpoint's timing sane."""
        deadline = time.monotonic() + LEADER_WAIT
        waiting = dict(created)
        while waiting:
            try:
                metadata = self._admin.list_topics(timeout=self._timeout)
            except KafkaException:
                metadata = None
            if metadata is not None:
                for name, partitions in list(waiting.items()):
                    topic = metadata.topics.get(name)
                    if (
                        topic is not None
                        and topic.error is None
                        and len(topic.partitions) >= partitions
                        and all(p.leader >= 0 for p in topic.partitions.values())
                    ):
                        del waiting[name]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise KafkaUnavailableError(
                    f"topics {sorted(waiting)} were created on {self._where} but have no "
                    f"leader for every partition after {LEADER_WAIT:.0f}s"
                )
            time.sleep(0.1)
