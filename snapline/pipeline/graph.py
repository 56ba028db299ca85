"""The declared dataflow: ``Pipeline`` and ``Stream`` build a graph of nodes; nothing runs here.

``Pipeline.validate()`` checks everything that can be checked without a broker, so a broken
pipeline fails at start with a message that names the fix.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.functions import KeyedCoProcessFunction, KeyedProcessFunction
from snapline.pipeline.keygroups import DEFAULT_MAX_PARALLELISM, MAX_MAX_PARALLELISM
from snapline.pipeline.rolling import (
    RollingAggregate,
    rolling_aggregate,
    rolling_count,
    rolling_reduce,
)
from snapline.pipeline.state import BACKENDS
from snapline.pipeline.state.descriptors import StateDescriptor, declared_states
from snapline.pipeline.state.serde import Serde
from snapline.pipeline.state.timers import TimerState

if TYPE_CHECKING:
    from datetime import timedelta

    from snapline.connectors.kafka_source import KafkaSource
    from snapline.pipeline.sink import Sink
    from snapline.pipeline.stages import StagePlan
    from snapline.pipeline.state.descriptors import AggregateFunction
    from snapline.pipeline.windows import WindowAssigner, WindowedStream, WindowSpec

GUARANTEES = ("exactly_once", "at_least_once")
#: Node kinds that hold keyed state (and so have a uid in savepoints).
STATEFUL_KINDS = ("process", "co_process", "window")
ON_ERROR = ("dead_letter", "fail")
ON_CORRUPT = ("fail", "rewind")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")


@dataclass(eq=False)
class Node:
    """One operator of the graph."""

    # source | map | filter | flat_map | key_by | process | co_process | window | union | sink
    kind: str
    inputs: list[Node]
    fn: Any = None
    name: str = ""
    keyed: bool = False
    id: int = -1
    options: dict[str, Any] = field(default_factory=dict)


class Stream:
    """A stream of records in a pipeline; every method returns a new stream."""

    def __init__(self, pipeline: Pipeline, node: Node) -> None:
        self._pipeline = pipeline
        self.node = node

    def _then(self, kind: str, fn: Any, *, keyed: bool, name: str = "", **options: Any) -> Stream:
        if not callable(fn) and not (kind == "key_by" and fn is None):
            raise ConfigurationError(f"{kind}() needs a function, got {fn!r}")
        _reject_state_on(kind, fn)
        node = self._pipeline._add(
            Node(kind, [self.node], fn, name or kind, keyed, options=options)
        )
        return Stream(self._pipeline, node)

    def map(self, fn: Callable[[Any], Any], *, name: str = "") -> Stream:
        """Replace each value by ``fn(value)``."""
        return self._then("map", fn, keyed=self.node.keyed, name=name)

    def filter(self, fn: Callable[[Any], bool], *, name: str = "") -> Stream:
        """Keep values for which ``fn(value)`` is true."""
        return self._then("filter", fn, keyed=self.node.keyed, name=name)

    def flat_map(self, fn: Callable[[Any], Iterable[Any]], *, name: str = "") -> Stream:
        """Replace each value by the zero or more values ``fn(value)`` yields."""
        return self._then("flat_map", fn, keyed=self.node.keyed, name=name)

    def key_by(
        self,
        fn: Callable[[Any], Any] | None = None,
        *,
        name: str = "",
        partitions: int | None = None,
        trust_partitioning: bool = False,
    ) -> KeyedStream:
        """Key the stream by ``fn(value)``; with no function, by the Kafka message key.

        With a function, the records are re-keyed through an internal repartition topic
        ``<pipeline>.<name>.repartition`` (``name`` defaults to ``key_by-<n>``, the n-th
        re-keying ``key_by`` of the pipeline; name it explicitly so that upgrades keep the
        topic): a new stage starts there, with ``partitions`` tasks (default: the largest
        source partition count), each owning a contiguous range of key-groups. The records
        cross the topic inside the stage's Kafka transaction, so exactly-once holds. ``fn``
        must not modify the value: a record read straight from a JSON source crosses the topic
        as the bytes it was read as (no second encoding).

        Without a function, or with ``trust_partitioning=True`` (the input topic is already
        partitioned by this key, e.g. produced with it as the message key), no topic is used:
        the state lives in the tasks of the current stage.
        """
        if partitions is not None and (
            not isinstance(partitions, int) or isinstance(partitions, bool) or partitions < 1
        ):
            raise ConfigurationError(f"key_by(partitions={partitions!r}) must be an int >= 1")
        repartition = fn is not None and not trust_partitioning
        if partitions is not None and not repartition:
            raise ConfigurationError(
                "key_by(partitions=...) applies to a re-keying key_by (with a function and "
                "without trust_partitioning=True)"
            )
        node = self._then(
            "key_by",
            fn,
            keyed=True,
            name=name,
            repartition=repartition,
            partitions=partitions,
            named=bool(name),
        ).node
        return KeyedStream(self._pipeline, node)

    def process(self, function: KeyedProcessFunction, *, name: str = "") -> Stream:
        raise ConfigurationError(
            f"process({type(function).__name__}) needs a keyed stream: call "
            ".key_by(lambda value: <key>) before .process(...)"
        )

    def count(
        self, *, ttl: float | timedelta | None = None, name: str = "", uid: str | None = None
    ) -> Stream:
        raise _needs_key("count()")

    def reduce(
        self,
        fn: Callable[[Any, Any], Any],
        *,
        ttl: float | timedelta | None = None,
        name: str = "",
        uid: str | None = None,
    ) -> Stream:
        raise _needs_key("reduce(fn)")

    def aggregate(
        self,
        function: AggregateFunction[Any, Any, Any],
        *,
        serde: Serde | str | None = None,
        ttl: float | timedelta | None = None,
        name: str = "",
        uid: str | None = None,
    ) -> Stream:
        raise _needs_key("aggregate(function)")

    def window(
        self,
        assigner: WindowAssigner,
        *,
        allowed_lateness: int | timedelta = 0,
        on_late: str = "dead_letter",
        name: str = "",
    ) -> WindowedStream:
        raise ConfigurationError(
            "window() needs a keyed stream: call .key_by(lambda value: <key>) before .window(...)"
        )

    def union(self, *others: Stream) -> Stream:
        """Merge this stream with others (from co-partitioned topics); barriers are aligned."""
        if not others:
            raise ConfigurationError("union() needs at least one other stream")
        for other in others:
            if other._pipeline is not self._pipeline:
                raise ConfigurationError("union() of streams from different pipelines")
        nodes = [self.node, *(o.node for o in others)]
        keyed = all(n.keyed for n in nodes)
        node = self._pipeline._add(Node("union", nodes, None, "union", keyed))
        return KeyedStream(self._pipeline, node) if keyed else Stream(self._pipeline, node)

    def sink(self, sink: Sink) -> Stream:
        """Write the stream to ``sink``; returns this stream so more sinks can follow."""
        from snapline.pipeline.sink import Sink

        if not isinstance(sink, Sink):
            raise ConfigurationError(
                f"sink() needs a Sink (KafkaSink, ParquetSink, PostgresSink...), got {sink!r}"
            )
        self._pipeline._add(Node("sink", [self.node], sink, sink.name, self.node.keyed))
        return self


class KeyedStream(Stream):
    """A stream whose records carry a key; ``process`` may use keyed state."""

    def process(
        self, function: KeyedProcessFunction, *, name: str = "", uid: str | None = None
    ) -> KeyedStream:
        """Run ``function`` per key with its keyed state. ``uid`` is the operator's stable id
        in savepoints (default: ``name``, else the function's class name, with ``-2``, ``-3``
        ... for repeats); set it explicitly before an upgrade may rename things."""
        if not isinstance(function, KeyedProcessFunction):
            raise ConfigurationError(
                f"process() needs a KeyedProcessFunction instance, got {function!r}"
            )
        node = self._pipeline._add(
            Node(
                "process",
                [self.node],
                function,
                name or type(function).__name__,
                True,
                options={"uid": uid},
            )
        )
        return KeyedStream(self._pipeline, node)

    def count(
        self, *, ttl: float | timedelta | None = None, name: str = "", uid: str | None = None
    ) -> KeyedStream:
        """A rolling count per key: each record emits ``{"key": key, "value": n}``, n the
        number of the key's records so far (not windowed: see ``window(...).count()``).
        ``ttl`` (seconds or timedelta, processing time): a key's count expires that long
        after its last record, and the key counts from 1 again."""
        return self.process(rolling_count(ttl), name=name or "count", uid=uid)

    def reduce(
        self,
        fn: Callable[[Any, Any], Any],
        *,
        ttl: float | timedelta | None = None,
        name: str = "",
        uid: str | None = None,
    ) -> KeyedStream:
        """A rolling reduce per key: each record emits ``{"key": key, "value": acc}`` where
        ``acc = fn(acc, value)`` (the key's first value as it is). The accumulator is keyed
        state stored as JSON; ``fn`` returning None sends the record to the dead letters.
        ``ttl``: as for ``count()``."""
        return self.process(rolling_reduce(fn, ttl), name=name or "reduce", uid=uid)

    def aggregate(
        self,
        function: AggregateFunction[Any, Any, Any],
        *,
        serde: Serde | str | None = None,
        ttl: float | timedelta | None = None,
        name: str = "",
        uid: str | None = None,
    ) -> KeyedStream:
        """A rolling aggregate per key: each record emits ``{"key": key, "value":
        function.get_result(acc)}`` after ``acc = function.add(value, acc)`` (starting from
        ``create_accumulator()``). The accumulator is keyed state stored with ``serde`` (JSON
        by default), e.g. a running total or average per customer. ``ttl``: as for
        ``count()`` (an expired key starts again from ``create_accumulator()``)."""
        return self.process(
            rolling_aggregate(function, serde, ttl), name=name or "aggregate", uid=uid
        )

    def window(
        self,
        assigner: WindowAssigner,
        *,
        allowed_lateness: int | timedelta = 0,
        on_late: str = "dead_letter",
        name: str = "",
    ) -> WindowedStream:
        """Cut the keyed stream into event-time windows (``from snapline import tumbling,
        hopping, sliding, session``); finish with ``.count()``, ``.reduce(fn)`` or
        ``.aggregate(AggregateFunction)``. A window's result is emitted once the watermark
        passes its end; records arriving later than ``allowed_lateness`` (ms or timedelta)
        after that go to the dead-letter topic with the reason (``on_late="drop"``: counted
        and dropped); records within it update the window and emit it again."""
        from snapline.pipeline.windows import WindowAssigner, WindowedStream, check_window_args

        if not isinstance(assigner, WindowAssigner):
            raise ConfigurationError(
                "window() needs a window assigner such as snapline.tumbling(60_000), "
                f"got {assigner!r}"
            )
        lateness = check_window_args(allowed_lateness, on_late)
        return WindowedStream(self, assigner, lateness, on_late, name)

    def _window_node(self, spec: WindowSpec, name: str) -> KeyedStream:
        node = self._pipeline._add(Node("window", [self.node], spec, name, True))
        return KeyedStream(self._pipeline, node)

    def connect(self, other: KeyedStream) -> ConnectedStreams:
        """Pair this keyed stream (left) with ``other`` (right) for a
        ``KeyedCoProcessFunction``: records of both with the same key share keyed state."""
        if not isinstance(other, KeyedStream):
            raise ConfigurationError(
                f"connect() needs a keyed stream (call .key_by(...) on it first), got {other!r}"
            )
        if other._pipeline is not self._pipeline:
            raise ConfigurationError("connect() of streams from different pipelines")
        return ConnectedStreams(self._pipeline, self.node, other.node)


class ConnectedStreams:
    """Two keyed streams processed together (``KeyedStream.connect``)."""

    def __init__(self, pipeline: Pipeline, left: Node, right: Node) -> None:
        self._pipeline = pipeline
        self._left = left
        self._right = right

    def process(
        self, function: KeyedCoProcessFunction, *, name: str = "", uid: str | None = None
    ) -> KeyedStream:
        """Run ``function``: ``process_left`` for records of the left stream,
        ``process_right`` for the right one, with the function's keyed state shared."""
        if not isinstance(function, KeyedCoProcessFunction):
            raise ConfigurationError(
                f"connect(...).process() needs a KeyedCoProcessFunction instance, got {function!r}"
            )
        node = self._pipeline._add(
            Node(
                "co_process",
                [self._left, self._right],
                function,
                name or type(function).__name__,
                True,
                options={"uid": uid},
            )
        )
        return KeyedStream(self._pipeline, node)


def _needs_key(call: str) -> ConfigurationError:
    return ConfigurationError(
        f"{call} is a rolling aggregation per key and needs a keyed stream: call "
        f".key_by(lambda value: <key>) before .{call}"
    )


def _reject_state_on(kind: str, fn: Any) -> None:
    owner = fn if isinstance(fn, type) else type(fn)
    if fn is not None and kind != "sink" and declared_states(owner):
        raise ConfigurationError(
            f"{kind}() got {owner.__name__}, which declares keyed state; state works only in "
            "a KeyedProcessFunction used as .key_by(...).process(fn)"
        )


class Pipeline:
    """A declared dataflow plus its fault-tolerance settings.

    ``name`` keys the consumer group, the transactional ids and the checkpoint directory.
    """

    def __init__(
        self,
        name: str,
        *,
        checkpoint_interval: float = 1.0,
        state_backend: str = "memory",
        guarantee: str = "exactly_once",
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        checkpoint_dir: str | None = None,
        retained_checkpoints: int = 3,
        checkpoint_timeout: float = 60.0,
        tolerable_failed_checkpoints: int = 3,
        on_error: str = "dead_letter",
        dead_letter_topic: str | None = None,
        on_corrupt_checkpoint: str = "fail",
        kafka_config: dict[str, Any] | None = None,
        state_backend_options: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.checkpoint_interval = checkpoint_interval
        self.state_backend = state_backend
        self.guarantee = guarantee
        self.max_parallelism = max_parallelism
        self.checkpoint_dir = checkpoint_dir
        self.retained_checkpoints = retained_checkpoints
        self.checkpoint_timeout = checkpoint_timeout
        self.tolerable_failed_checkpoints = tolerable_failed_checkpoints
        self.on_error = on_error
        self.dead_letter_topic = dead_letter_topic or f"{name}.dead-letter"
        self.on_corrupt_checkpoint = on_corrupt_checkpoint
        if kafka_config is not None and not isinstance(kafka_config, dict):
            raise ConfigurationError(
                f"kafka_config must be a dict of librdkafka settings, not a "
                f"{type(kafka_config).__name__} (its values are not shown: they may be "
                "credentials), e.g. "
                '{"bootstrap.servers": "kafka:9092"}'
            )
        self.kafka_config = dict(kafka_config or {})
        self.state_backend_options = dict(state_backend_options or {})
        self.nodes: list[Node] = []
        #: ``key_by`` name -> the generation of its repartition topic
        #: (``stages.repartition_topic``): 0 unless a savepoint restore replaced it; the
        #: job's own, read from its checkpoint directory
        #: (``savepoint.markers.use_topic_generations``) before stages are compiled against
        #: Kafka.
        self.topic_generations: dict[str, int] = {}
        self._ids = itertools.count()
        self._check_settings()

    def _check_settings(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigurationError(
                f"pipeline name {self.name!r} must be 1-100 characters of letters, digits, "
                "'.', '_' or '-' (it names the consumer group and the checkpoint directory)"
            )
        interval = self.checkpoint_interval
        if (
            not isinstance(interval, int | float)
            or isinstance(interval, bool)
            or not 0.05 <= interval <= 3600
        ):
            raise ConfigurationError(
                f"checkpoint_interval={interval!r} must be seconds between 0.05 and 3600 "
                "(1.0 is a good default)"
            )
        if self.state_backend not in BACKENDS:
            raise ConfigurationError(
                f"state_backend={self.state_backend!r} is unknown; use one of {list(BACKENDS)}"
            )
        if self.guarantee not in GUARANTEES:
            raise ConfigurationError(
                f"guarantee={self.guarantee!r} is unknown; use one of {list(GUARANTEES)}"
            )
        if not isinstance(self.max_parallelism, int) or not (
            1 <= self.max_parallelism <= MAX_MAX_PARALLELISM
        ):
            raise ConfigurationError(
                f"max_parallelism={self.max_parallelism!r} must be an int in "
                f"1..{MAX_MAX_PARALLELISM}"
            )
        if not isinstance(self.retained_checkpoints, int) or self.retained_checkpoints < 1:
            raise ConfigurationError(
                f"retained_checkpoints={self.retained_checkpoints!r} must be an int >= 1"
            )
        timeout = self.checkpoint_timeout
        if (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or not 1 <= timeout <= 600
        ):
            raise ConfigurationError(
                f"checkpoint_timeout={self.checkpoint_timeout!r} must be 1..600 seconds"
            )
        tolerable = self.tolerable_failed_checkpoints
        if not isinstance(tolerable, int) or isinstance(tolerable, bool) or tolerable < 0:
            raise ConfigurationError(
                f"tolerable_failed_checkpoints={tolerable!r} must be an int >= 0 (checkpoints "
                "that may fail in a row before the worker stops; 3 is the default)"
            )
        if self.on_error not in ON_ERROR:
            raise ConfigurationError(f"on_error={self.on_error!r}; use one of {list(ON_ERROR)}")
        if self.on_corrupt_checkpoint not in ON_CORRUPT:
            raise ConfigurationError(
                f"on_corrupt_checkpoint={self.on_corrupt_checkpoint!r}; use one of "
                f"{list(ON_CORRUPT)}"
            )
        for reserved in ("group.id", "transactional.id", "isolation.level", "enable.auto.commit"):
            if reserved in self.kafka_config:
                raise ConfigurationError(
                    f"kafka_config sets {reserved!r}, which Snapline manages for exactly-once; "
                    "remove it"
                )

    @property
    def exactly_once(self) -> bool:
        return self.guarantee == "exactly_once"

    def _add(self, node: Node) -> Node:
        node.id = next(self._ids)
        self.nodes.append(node)
        return node

    def source(self, source: KafkaSource) -> Stream:
        """Start a stream from a Kafka source."""
        from snapline.connectors.kafka_source import KafkaSource

        if not isinstance(source, KafkaSource):
            raise ConfigurationError(f"source() needs a KafkaSource, got {source!r}")
        return Stream(
            self, self._add(Node("source", [], source, "source:" + ",".join(source.topic_list)))
        )

    # ----------------------------------------------------------------- queries
    def sources(self) -> list[KafkaSource]:
        return [n.fn for n in self.nodes if n.kind == "source"]

    def source_topics(self) -> list[str]:
        return [t for s in self.sources() for t in s.topic_list]

    def sinks(self) -> list[Sink]:
        return [n.fn for n in self.nodes if n.kind == "sink"]

    def downstream(self, node: Node) -> list[Node]:
        return [n for n in self.nodes if node in n.inputs]

    def state_ids(self) -> dict[int, list[tuple[int, StateDescriptor]]]:
        """State id per declared state, per keyed operator: ids are unique within the
        pipeline. The timers of each keyed operator are one more state, numbered after every
        declared state (so adding timers keeps the ids of existing state)."""
        result: dict[int, list[tuple[int, StateDescriptor]]] = {}
        next_id = 1
        for node in self.nodes:
            if node.kind in STATEFUL_KINDS:
                result[node.id] = []
                declared = (
                    node.fn.states()
                    if node.kind == "window" or isinstance(node.fn, RollingAggregate)
                    else declared_states(type(node.fn))
                )
                for desc in declared:
                    result[node.id].append((next_id, desc))
                    next_id += 1
        for entries in result.values():
            entries.append((next_id, TimerState()))
            next_id += 1
        if next_id > 256:
            raise ConfigurationError("a pipeline may declare at most 255 keyed states")
        return result

    def operator_uids(self) -> dict[int, str]:
        """The stable id of every stateful operator (node id -> uid), as savepoints name them:
        an explicit ``uid=``, else the operator's name with ``-2``, ``-3`` ... for repeats."""
        uids: dict[int, str] = {}
        explicit = [str(n.options["uid"]) for n in self.nodes if n.options.get("uid")]
        dupes = sorted({u for u in explicit if explicit.count(u) > 1})
        if dupes:
            raise ConfigurationError(f"operator uids {dupes} are used twice; uids must be unique")
        taken = set(explicit)
        for node in self.nodes:
            if node.kind not in STATEFUL_KINDS:
                continue
            uid = node.options.get("uid")
            if not uid:
                base = re.sub(r"[^A-Za-z0-9._-]+", "-", node.name).strip("-.").lstrip("_")[:90]
                base = base or "operator"  # a private class, _Stamp, is named Stamp
                uid, n = base, 1
                while uid in taken:
                    n += 1
                    uid = f"{base}-{n}"
            if not isinstance(uid, str) or not _NAME.match(uid):
                raise ConfigurationError(
                    f"operator uid {uid!r} must be 1-100 letters, digits, '.', '_' or '-', "
                    "starting with a letter or digit"
                )
            taken.add(uid)
            uids[node.id] = uid
        return uids

    def validate(self) -> None:
        """Check the graph; raises ConfigurationError naming the fix."""
        self._check_settings()
        if not self.sources():
            raise ConfigurationError(
                f"pipeline {self.name!r} has no source; add pipeline.source(KafkaSource(...))"
            )
        if not self.sinks():
            raise ConfigurationError(
                f"pipeline {self.name!r} has no sink; add .sink(KafkaSink(...)) to a stream"
            )
        topics = self.source_topics()
        duplicates = sorted({t for t in topics if topics.count(t) > 1})
        if duplicates:
            raise ConfigurationError(f"topics {duplicates} are read by more than one source")
        names = [s.name for s in self.sinks()]
        dup_sinks = sorted({n for n in names if names.count(n) > 1})
        if dup_sinks:
            raise ConfigurationError(
                f"sink names {dup_sinks} are used twice; pass name=... to tell them apart"
            )
        self._check_state_names()
        self.stages()

    def _check_state_names(self) -> None:
        """Each state of an operator has a name of its own, not the timers' one: checkpoints
        and savepoints find a state by (operator uid, state name), so two states of one name
        would be restored as one (and a checkpoint of them refused as renumbered)."""
        uids = self.operator_uids()
        timers = TimerState().name
        problems = []
        for node_id, entries in self.state_ids().items():
            declared = [d for _, d in entries if not isinstance(d, TimerState)]
            names = [d.name or "" for d in declared]
            for name in sorted({n for n in names if names.count(n) > 1}):
                attributes = ", ".join(str(d.attribute) for d in declared if d.name == name)
                problems.append(
                    f"states {attributes} of operator {uids[node_id]!r} are all named {name!r}"
                )
            if timers in names:
                problems.append(
                    f"a state of operator {uids[node_id]!r} is named {timers!r}, the name of "
                    "its timers"
                )
        if problems:
            raise ConfigurationError(
                "; ".join(problems) + ". Each state of an operator needs a name of its own "
                f"(checkpoints and savepoints find a state by name) other than {timers!r}: "
                'pass another name, e.g. MapState("seen")'
            )

    def stages(self) -> StagePlan:
        """The graph compiled into stages (``snapline.pipeline.stages``)."""
        from snapline.pipeline.stages import compile_stages

        return compile_stages(self)

    def repartition_topics(self) -> list[str]:
        return [r.topic for r in self.stages().repartitions.values()]


def load_pipeline(spec: str) -> Pipeline:
    """Import ``module:attribute`` and return the Pipeline it names."""
    import importlib

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(
            f"{spec!r} is not module:attribute, e.g. examples.word_count:pipeline"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    try:
        value = getattr(module, attribute)
    except AttributeError:
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if callable(value) and not isinstance(value, Pipeline):
        value = value()
    if not isinstance(value, Pipeline):
        raise ConfigurationError(f"{spec} is a {type(value).__name__}, not a Pipeline")
    return value
