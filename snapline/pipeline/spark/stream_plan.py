"""What ``snapline spark stream`` runs: the declared graph checked and cut into the two parts
of a Structured Streaming query, or a ConfigurationError at start naming what cannot map.

A supported pipeline is one or more Kafka sources, stateless operators (``union`` among them)
before at most one ``key_by``, and after it keyed process functions and stateless operators (any
operator may feed several), with sinks hanging off any operator:

    source → (map | filter | flat_map)* ─┬→ union → ... → key_by → (process | window | map | ...)*
    source → (map | filter | flat_map)* ─┘  ↘ (map | filter | flat_map)*  ↘ (process | ...)*
                                              (branches without key_by: sinks only)

Several sources are read by one Spark Kafka source subscribed to all their topics; each record
starts at its own source's step (``StreamPlan.roots``), decoded with that source's formats.
They must share a starting position; the query's one watermark trails by the largest
``max_out_of_orderness`` among them.

The part before ``key_by`` runs per micro-batch on the executors; the part after it runs per
key through ``transformWithState``: every branch sees the key's records in the same order, in
one state store, as the operators of a service task do. Outputs of the part before ``key_by``
that go to sinks pass through the keyed part's grouping unchanged (``stream_ops.PASS_PREFIX``).
At most one operator of the keyed part may use event-time timers (a window, or a process
function implementing ``on_timer``): Spark keeps one set of timers per key. ``run_chain``
pushes one value through a part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.functions import Context, KeyedProcessFunction

if TYPE_CHECKING:
    from snapline.connectors.kafka_source import KafkaSource
    from snapline.pipeline.graph import Node, Pipeline
    from snapline.pipeline.sink import Sink

#: Operator kinds a chain may hold; "pass" is the source or the key_by itself (sinks may hang
#: off it).
STATELESS = ("map", "filter", "flat_map")


@dataclass(frozen=True)
class Step:
    """One operator of a part, the sinks (indexes into ``StreamPlan.sinks``) its output feeds,
    and the steps (indexes into the part) its output goes on to: None for the next one in the
    list (a chain), ``()`` for none (the end of a branch)."""

    kind: str
    node_id: int
    sinks: tuple[int, ...] = ()
    next: tuple[int, ...] | None = None


@dataclass(frozen=True)
class StreamPlan:
    #: The first source (its starting position is every source's).
    source: KafkaSource
    #: Before ``key_by``: each source's "pass" step (``roots``) and the steps below them, a
    #: graph in depth-first order whose branches may meet again at a ``union``.
    pre: tuple[Step, ...]
    #: The ``key_by`` node id, or None for a pipeline without keyed state.
    key_by: int | None
    #: After ``key_by`` (starts with its "pass" step), a tree in depth-first order: every
    #: step names the steps it feeds (``Step.next``); empty without ``key_by``.
    keyed: tuple[Step, ...]
    sinks: tuple[Sink, ...]
    #: The one keyed operator with event-time timers (a window, or a process function that
    #: implements on_timer), or None: the query then runs without event time.
    timed: int | None = None
    #: Every source, in the pipeline's order, and the step of ``pre`` each one starts at.
    sources: tuple[KafkaSource, ...] = ()
    roots: tuple[int, ...] = (0,)

    @property
    def process_ids(self) -> tuple[int, ...]:
        return tuple(s.node_id for s in self.keyed if s.kind == "process")

    @property
    def topics(self) -> list[str]:
        """Every source topic, each once."""
        return list(
            dict.fromkeys(t for src in (self.sources or (self.source,)) for t in src.topic_list)
        )

    @property
    def max_out_of_orderness(self) -> int:
        """The query's watermark delay (ms): the largest of the sources'."""
        from snapline.pipeline.time import duration_ms

        return max(
            duration_ms(src.max_out_of_orderness, "max_out_of_orderness")
            for src in (self.sources or (self.source,))
        )


def _refuse(what: str, fix: str) -> ConfigurationError:
    return ConfigurationError(f"snapline spark stream cannot run {what} yet: {fix}")


def plan_stream(pipeline: Pipeline) -> StreamPlan:
    """Check ``pipeline`` for the streaming runner (see module); ConfigurationError if any part
    cannot map onto a Structured Streaming query."""
    pipeline.validate()
    if not pipeline.exactly_once:
        raise ConfigurationError("snapline spark stream needs guarantee='exactly_once'")
    sources = [n for n in pipeline.nodes if n.kind == "source"]
    positions = {n.fn.starting_position for n in sources}
    if len(positions) > 1:
        raise _refuse(
            f"sources with different starting positions ({sorted(positions)})",
            "give every KafkaSource the same starting_position (the query starts all its "
            "topics one way), or run the pipeline as services (snapline run)",
        )
    sinks: list[Sink] = []
    pre: list[Step] = []
    keyed: list[Step] = []
    found: list[Node] = []  # the key_by
    visited: dict[int, int] = {}
    roots = [_pre_tree(pipeline, n, "pass", sinks, pre, found, visited) for n in sources]
    pre = _resolved(pre)
    key_by: int | None = None
    if found:
        key_by = found[0].id
        _keyed_tree(pipeline, found[0], "pass", sinks, keyed, {})
        mixed = {s.node_id for s in pre} & {s.node_id for s in keyed}
        if mixed:
            by_id = {n.id: n for n in pipeline.nodes}
            raise _refuse(
                f"{sorted(by_id[i].name for i in mixed)}, which take both streams before and "
                "after key_by",
                "combine the streams before key_by, or key every one of them",
            )
    by_id = {n.id: n for n in pipeline.nodes}
    timed = [s for s in keyed if s.kind == "window" or _has_timers(by_id[s.node_id].fn)]
    if len(timed) > 1:
        raise _refuse(
            f"{len(timed)} operators with timers ({[by_id[s.node_id].name for s in timed]})",
            "Spark keeps one set of timers per key, so one window or on_timer function per "
            "pipeline; split the pipeline or run it as services",
        )
    return StreamPlan(
        sources[0].fn,
        tuple(pre),
        key_by,
        tuple(keyed),
        tuple(sinks),
        timed[0].node_id if timed else None,
        tuple(n.fn for n in sources),
        tuple(roots),
    )


def _step(
    pipeline: Pipeline, node: Node, kind: str, sinks: list[Sink], steps: list[Step]
) -> list[Node]:
    """Append ``node``'s step (its sinks added to ``sinks``); the operators it feeds."""
    below = pipeline.downstream(node)
    sink_nodes = [n for n in below if n.kind == "sink"]
    indexes = tuple(range(len(sinks), len(sinks) + len(sink_nodes)))
    sinks.extend(n.fn for n in sink_nodes)
    steps.append(Step(kind, node.id, indexes))
    return [n for n in below if n.kind != "sink"]


#: In ``_pre_tree``'s steps until ``_resolved``: "on to the key_by" (the end of the part).
_TO_KEY_BY = -1


def _pre_tree(
    pipeline: Pipeline,
    node: Node,
    kind: str,
    sinks: list[Sink],
    steps: list[Step],
    found: list[Node],
    visited: dict[int, int],
) -> int:
    """Append the part before ``key_by`` from ``node`` on, depth first; the key_by node goes
    into ``found`` (a second one is refused) and its feeder's ``next`` names _TO_KEY_BY. A
    node reached again (a ``union``'s other input) keeps its first step: ``visited`` maps
    node ids to their steps."""
    if node.id in visited:
        return visited[node.id]
    index = len(steps)
    visited[node.id] = index
    children = []
    for child in _step(pipeline, node, kind, sinks, steps):
        if child.kind == "key_by":
            if found and found[0].id == child.id:  # reached again through a union
                children.append(_TO_KEY_BY)
                continue
            if found:
                raise _refuse(
                    f"a second key_by ({child.name!r} beside {found[0].name!r})",
                    "one key_by per pipeline on Spark streaming: key every branch the same "
                    "way after one key_by, give each its own pipeline, or run it as services",
                )
            found.append(child)
            children.append(_TO_KEY_BY)
            continue
        _check_kind(child)
        children.append(_pre_tree(pipeline, child, child.kind, sinks, steps, found, visited))
    step = steps[index]
    steps[index] = Step(step.kind, step.node_id, step.sinks, tuple(children))
    return index


def _resolved(steps: list[Step]) -> list[Step]:
    """The part before ``key_by`` with _TO_KEY_BY resolved to the part's end (where
    ``run_chain`` hands a value to ``emit_end``, the key_by)."""
    end = len(steps)
    return [
        Step(s.kind, s.node_id, s.sinks, tuple(end if j == _TO_KEY_BY else j for j in s.next or ()))
        for s in steps
    ]


def _keyed_tree(
    pipeline: Pipeline,
    node: Node,
    kind: str,
    sinks: list[Sink],
    steps: list[Step],
    visited: dict[int, int],
) -> int:
    """Append the keyed part from ``node`` on, depth first; ``node``'s index (its first one,
    for a node reached again through a ``union``)."""
    if node.id in visited:
        return visited[node.id]
    index = len(steps)
    visited[node.id] = index
    children = []
    for child in _step(pipeline, node, kind, sinks, steps):
        if child.kind == "key_by":
            raise _refuse(
                f"a second key_by ({child.name!r}: a multi-stage pipeline)",
                "one key_by per pipeline on Spark streaming; run it as services or on "
                "Spark bounded (snapline spark run)",
            )
        _check_kind(child)
        children.append(_keyed_tree(pipeline, child, child.kind, sinks, steps, visited))
    step = steps[index]
    steps[index] = Step(step.kind, step.node_id, step.sinks, tuple(children))
    return index


def _check_kind(node: Node) -> None:
    if node.kind == "process":
        _check_process(node.fn, node.name)
    elif node.kind not in ("window", "union") and node.kind not in STATELESS:
        raise _refuse(f"the operator {node.name!r} ({node.kind})", "run it as services")


def _has_timers(fn: Any) -> bool:
    return isinstance(fn, KeyedProcessFunction) and (
        type(fn).on_timer is not KeyedProcessFunction.on_timer
    )


def _check_process(function: Any, name: str) -> None:
    if not isinstance(function, KeyedProcessFunction):
        raise _refuse(f"{name!r}", "only KeyedProcessFunction is supported")


def run_chain(
    steps: Sequence[Step],
    functions: Sequence[Any],
    value: Any,
    ctx: Context | None,
    emit_sink: Callable[[int, Any], None],
    emit_end: Callable[[Any], None] | None = None,
    start: int = 0,
    on_error: Callable[[int, Exception], None] | None = None,
) -> None:
    """Push ``value`` through step ``start`` and the steps after it (``functions[i]`` is step
    i's function, bound process function, or for a window a function from a value to the
    window's outputs): every output goes to the sinks of its step and on to the steps it feeds
    (``Step.next``, in order, depth first); what leaves the end of a chain goes to
    ``emit_end`` (the key_by) when given.

    A step that raises: without ``on_error`` the exception ends the run. With it, as in a
    service task, only that step fails: ``on_error(step index, exception)`` is told, the
    outputs a generator yielded before raising are dropped (half a result beside a dead
    letter, as the services' process function and flat_map do not output), and every
    other branch runs."""
    end = len(steps)

    def push(i: int, v: Any) -> None:
        if i == end:
            if emit_end is not None:
                emit_end(v)
            return
        step = steps[i]
        fn = functions[i]
        outs: list[Any] = []
        try:
            if step.kind in ("pass", "union"):
                outs.append(v)
            elif step.kind == "map":
                outs.append(fn(v))
            elif step.kind == "filter":
                if fn(v):
                    outs.append(v)
            elif step.kind in ("flat_map", "window"):
                outs.extend(fn(v) or ())
            else:
                outs.extend(fn.process(v, ctx) or ())
        except Exception as exc:
            if on_error is None:
                raise
            on_error(i, exc)
            outs.clear()
        after = (i + 1,) if step.next is None else step.next
        for out in outs:
            for sink in step.sinks:
                emit_sink(sink, out)
            for j in after:
                push(j, out)

    push(start, value)
