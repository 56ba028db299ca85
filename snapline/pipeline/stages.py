"""Stages: the declared graph cut at Kafka topics (DESIGN §2, §4); pure, no broker.

A stage starts at Kafka topics — the sources, or the internal repartition topic of a re-keying
``key_by`` — and ends at sinks or at the next repartition topic. A task is one partition of
one stage: ``p<n>`` in the source stage (0), ``s<k>-p<n>`` in stage k. A re-keying ``key_by``
belongs to the stage that writes its topic; the stage that reads the topic starts there.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from snapline.pipeline.errors import ConfigurationError

if TYPE_CHECKING:  # the graph calls compile_stages; this module only reads it
    from snapline.pipeline.graph import Node, Pipeline

SOURCE_STAGE = 0
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")


@dataclass(frozen=True)
class Repartition:
    """The internal topic of one re-keying ``key_by``: written by ``upstream``, read by
    ``downstream``; ``partitions`` is the declared count (None: the default, the largest
    source partition count)."""

    node_id: int
    name: str
    topic: str
    partitions: int | None
    upstream: int
    downstream: int


@dataclass(frozen=True)
class Stage:
    """One stage: the operators (node ids) its tasks run, and the repartition topics it reads
    (none for the source stage, which reads the pipeline's sources)."""

    index: int
    node_ids: frozenset[int]
    reads: tuple[str, ...]


@dataclass(frozen=True)
class StagePlan:
    stages: tuple[Stage, ...]
    #: key_by node id -> its repartition topic
    repartitions: Mapping[int, Repartition]

    def stage_of_topics(self, source_topics: list[str]) -> dict[str, int]:
        """Which stage reads each input topic (sources and repartition topics)."""
        result = dict.fromkeys(source_topics, SOURCE_STAGE)
        for rep in self.repartitions.values():
            result[rep.topic] = rep.downstream
        return result

    def input_topics(self, source_topics: list[str]) -> list[str]:
        return [*source_topics, *(r.topic for r in self.repartitions.values())]

    def in_dataflow_order(self) -> tuple[Stage, ...]:
        """The stages, each after every stage that writes a topic it reads.

        The numbering follows the graph's order of appearance, which union/connect can make
        differ from the dataflow (``h`` may write stage 2 into stage 1); it names tasks,
        checkpoints and savepoints, so it stays, and a run that goes stage by stage takes this
        order. Among the stages ready at once the lowest number comes first: a plan numbered
        in dataflow order keeps its order."""
        order, cycle = _dataflow_order(len(self.stages), self.repartitions.values())
        if cycle:
            raise _cycle_error(cycle)
        return tuple(self.stages[i] for i in order)


def task_id_for(stage: int, partition: int) -> str:
    """The task id of ``partition`` of ``stage``: names its checkpoint and local state dirs."""
    return f"p{partition}" if stage == SOURCE_STAGE else f"s{stage}-p{partition}"


def repartition_partition(key_group: int, partitions: int, max_parallelism: int) -> int:
    """The repartition-topic partition of a key-group: contiguous key-group ranges per
    partition (``keygroups.operator_index_for_key_group``), so a rescale moves whole ranges."""
    return key_group * partitions // max_parallelism


def is_repartition(node: Node) -> bool:
    return node.kind == "key_by" and bool(node.options.get("repartition"))


def _dataflow_order(
    count: int, repartitions: Iterable[Repartition]
) -> tuple[list[int], list[Repartition]]:
    """Stages ``0 .. count-1`` in dataflow order (Kahn's algorithm, the lowest ready number
    first) and, if the stage graph has a cycle, the repartitions of one cycle in dataflow
    direction (the order then lacks the stages on and behind it)."""
    incoming: dict[int, list[Repartition]] = {i: [] for i in range(count)}
    outgoing: dict[int, list[Repartition]] = {i: [] for i in range(count)}
    for rep in sorted(repartitions, key=lambda r: r.node_id):
        incoming[rep.downstream].append(rep)
        outgoing[rep.upstream].append(rep)
    waiting = {i: len(reps) for i, reps in incoming.items()}
    ready = [i for i, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        stage = heapq.heappop(ready)
        order.append(stage)
        for rep in outgoing[stage]:
            waiting[rep.downstream] -= 1
            if waiting[rep.downstream] == 0:
                heapq.heappush(ready, rep.downstream)
    left = set(range(count)) - set(order)
    if not left:
        return order, []
    # Each stage left reads a topic that a stage left writes: walking back along those
    # writers comes round to a stage already passed, and the walk since then is a cycle.
    stage = min(left)
    path: list[Repartition] = []
    seen: dict[int, int] = {}
    while stage not in seen:
        seen[stage] = len(path)
        rep = next(r for r in incoming[stage] if r.upstream in left)
        path.append(rep)
        stage = rep.upstream
    return order, path[seen[stage] :][::-1]


def _cycle_error(cycle: list[Repartition]) -> ConfigurationError:
    hops = ", ".join(f"{r.name!r} (stage {r.upstream} -> {r.downstream})" for r in cycle)
    return ConfigurationError(
        f"key_by operators {hops} form a cycle of stages through union/connect: the "
        "watermark of each stage on it waits for the stage before, so their windows and "
        "event-time timers never fire; key the combined streams once instead"
    )


class _Stages:
    """Union-find over stage ids: a node with inputs from different stages merges them."""

    def __init__(self) -> None:
        self.parent = {SOURCE_STAGE: SOURCE_STAGE}

    def new(self) -> int:
        stage = len(self.parent)
        self.parent[stage] = stage
        return stage

    def find(self, stage: int) -> int:
        while self.parent[stage] != stage:
            self.parent[stage] = self.parent[self.parent[stage]]
            stage = self.parent[stage]
        return stage

    def union(self, a: int, b: int, node: Node) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if SOURCE_STAGE in (ra, rb):
            raise ConfigurationError(
                f"{node.kind} {node.name!r} combines a re-keyed stream (key_by with a function "
                "goes through a repartition topic) with a stream partitioned like the "
                "sources; re-key both sides with key_by(fn) so that they meet in one stage"
            )
        low, high = sorted((ra, rb))
        self.parent[high] = low
        return low


#: The last part of a ``key_by`` name that is kept for generations (``repartition_topic``).
_GENERATION = re.compile(r"g[0-9]+")


def repartition_topic(job: str, name: str, generation: int = 0) -> str:
    """The repartition topic of ``key_by(name=name)`` in job ``job``:
    ``<job>.<name>.repartition``, and ``<job>.<name>.g<n>.repartition`` from its ``n``-th
    replacement on. A savepoint restore that lowers a stage's partition count cannot remove
    partitions from the topic, so it replaces the topic by the next generation's, and no
    name is ever used again: a worker of the job before the restore, frozen and woken after
    it (a zombie), deletes records by topic name, and in a topic created again under its
    name (offsets from 0) it cut records the restored job had not read. The job's
    generations are stored in its checkpoint directory
    (``savepoint.markers.REPARTITION_TOPICS``)."""
    return (
        f"{job}.{name}.repartition"
        if generation == 0
        else f"{job}.{name}.g{generation}.repartition"
    )


def compile_stages(pipeline: Pipeline) -> StagePlan:
    """Cut ``pipeline``'s graph into stages; raises ConfigurationError naming the fix."""
    stages = _Stages()
    node_stage: dict[int, int] = {}
    out_stage: dict[int, int] = {}
    rekeying: list[tuple[Node, int]] = []
    for node in pipeline.nodes:  # topological order by construction
        if node.kind == "source":
            stage = SOURCE_STAGE
        else:
            stage = out_stage[node.inputs[0].id]
            for upstream in node.inputs[1:]:
                stage = stages.union(stage, out_stage[upstream.id], node)
        node_stage[node.id] = stage
        if is_repartition(node):
            downstream = stages.new()
            rekeying.append((node, downstream))
            out_stage[node.id] = downstream
        else:
            out_stage[node.id] = stage

    # Number the stages in order of appearance, the source stage first.
    numbering: dict[int, int] = {SOURCE_STAGE: SOURCE_STAGE}
    for node in pipeline.nodes:
        for stage in (node_stage[node.id], out_stage[node.id]):
            numbering.setdefault(stages.find(stage), len(numbering))

    def index(stage: int) -> int:
        return numbering[stages.find(stage)]

    repartitions: dict[int, Repartition] = {}
    names: dict[str, Node] = {}
    for ordinal, (node, downstream) in enumerate(rekeying, start=1):
        name = node.name if node.options.get("named") else f"key_by-{ordinal}"
        if name in names:
            raise ConfigurationError(
                f"two re-keying key_by operators are named {name!r}; names must be unique "
                "(they name the repartition topics)"
            )
        names[name] = node
        if _GENERATION.fullmatch(name.rsplit(".", 1)[-1]):
            # <job>.<a>.g1.repartition would be both key_by "a"'s first replacement and
            # key_by "a.g1"'s topic (or job <job>.<a>'s key_by "g1").
            raise ConfigurationError(
                f"key_by(name={name!r}): a name whose last part is g<number> is kept for the "
                "topics a savepoint restore replaces (<job>.<name>.g<n>.repartition); pick "
                "another name"
            )
        topic = repartition_topic(pipeline.name, name, pipeline.topic_generations.get(name, 0))
        if topic in {r.topic for r in repartitions.values()}:
            raise ConfigurationError(
                f"key_by(name={name!r}) gives the repartition topic {topic!r} of another "
                "key_by; give it another name"
            )
        if not _TOPIC_NAME.match(topic):
            raise ConfigurationError(
                f"key_by(name={name!r}) gives the repartition topic {topic!r}, which is not a "
                "valid Kafka topic name; use letters, digits, '.', '_' and '-'"
            )
        rep = Repartition(
            node.id,
            name,
            topic,
            node.options.get("partitions"),
            index(node_stage[node.id]),
            index(downstream),
        )
        if rep.upstream == rep.downstream:
            raise ConfigurationError(
                f"key_by {name!r} feeds a stage that also writes its repartition topic (a "
                "cycle through union/connect); key the combined streams once instead"
            )
        repartitions[node.id] = rep
    _, cycle = _dataflow_order(len(numbering), repartitions.values())
    if cycle:
        raise _cycle_error(cycle)

    # Topics read by one stage are co-partitioned: their declared counts must agree.
    by_stage: dict[int, list[Repartition]] = {}
    for rep in repartitions.values():
        by_stage.setdefault(rep.downstream, []).append(rep)
    for reps in by_stage.values():
        declared = {r.partitions for r in reps if r.partitions is not None}
        if len(declared) > 1:
            raise ConfigurationError(
                f"key_by operators {[r.name for r in reps]} feed one stage (through connect or "
                f"union) but declare different partitions {sorted(declared)}; give them the "
                "same partitions="
            )
        if declared:
            common = declared.pop()
            for rep in reps:
                repartitions[rep.node_id] = Repartition(
                    rep.node_id, rep.name, rep.topic, common, rep.upstream, rep.downstream
                )
        for rep in reps:
            count = repartitions[rep.node_id].partitions
            if count is not None and count > pipeline.max_parallelism:
                raise ConfigurationError(
                    f"key_by {rep.name!r}: partitions={count} exceeds max_parallelism="
                    f"{pipeline.max_parallelism}; a partition owns at least one key-group"
                )

    members: dict[int, set[int]] = {i: set() for i in range(len(numbering))}
    for node in pipeline.nodes:
        members[index(node_stage[node.id])].add(node.id)
    result = tuple(
        Stage(
            i,
            frozenset(members[i]),
            tuple(r.topic for r in repartitions.values() if r.downstream == i),
        )
        for i in range(len(numbering))
    )
    return StagePlan(result, repartitions)
