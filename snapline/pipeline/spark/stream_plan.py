"""What ``snapline spark stream`` runs: the declared graph checked and cut into the two parts
of a Structured Streaming query, or a ConfigurationError at start naming what cannot map.

A supported pipeline is one or more Kafka sources, stateless operators (``union`` among them)
before one ``key_by`` per stream, and after them keyed process functions (``connect`` with a
``KeyedCoProcessFunction`` among them) and stateless operators (any operator may feed several),
with sinks hanging off any operator:

    source → (map | filter | flat_map)* ─┬→ union → ... → key_by → (process | window | map | ...)*
    source → (map | filter | flat_map)* ─┘  ↘ (map | filter | flat_map)*  ↘ (process | ...)*
                                              (branches without key_by: sinks only)
    source → ... → key_by ─┐
    source → ... → key_by ─┴→ connect(...).process(co-process function) → ...

Several sources are read by one Spark Kafka source subscribed to all their topics; each record
starts at its own source's step (``StreamPlan.roots``), decoded with that source's formats.
They must share a starting position; the query's one watermark trails by the largest
``max_out_of_orderness`` among them. Streams keyed by ``key_by``s of their own are grouped
by key together, each record starting at its own ``key_by``'s step (``keyed_roots``); a
``connect`` has a step per side (``CO_SIDES``).

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
from snapline.pipeline.functions import Context, KeyedCoProcessFunction, KeyedProcessFunction

if TYPE_CHECKING:
    from snapline.connectors.kafka_source import KafkaSource
    from snapline.pipeline.graph import Node, Pipeline
    from snapline.pipeline.sink import Sink

#: Operator kinds a chain may hold; "pass" is the source or the key_by itself (sinks may hang
#: off it).
STATELESS = ("map", "filter", "flat_map")
#: The two steps of a ``connect(...).process(fn)`` node: records of its left input call
#: ``fn.process_left``, of its right one ``fn.process_right``; both feed the same sinks and
#: steps.
CO_SIDES = ("co_left", "co_right")


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
    #: Every source, in the pipeline's order, and the step of ``pre`` each one starts at.
    sources: tuple[KafkaSource, ...]
    roots: tuple[int, ...]
    #: Every ``key_by`` node id (the first is ``key_by``), and the step of ``keyed`` its
    #: records start at (its "pass" step). Several: the sides of a ``connect``, or keyed
    #: streams of their own, grouped by key in one state store.
    key_bys: tuple[int, ...]
    keyed_roots: tuple[int, ...]
    #: The one keyed operator with event-time timers (a window, or a process function that
    #: implements on_timer), or None: the query then runs without event time.
    timed: int | None = None

    @property
    def process_ids(self) -> tuple[int, ...]:
        """The keyed process functions' nodes (a co-process function's once)."""
        return tuple(
            dict.fromkeys(s.node_id for s in self.keyed if s.kind in ("process", *CO_SIDES))
        )

    @property
    def topics(self) -> list[str]:
        """Every source topic, each once."""
        return list(dict.fromkeys(t for src in self.sources for t in src.topic_list))

    @property
    def max_out_of_orderness(self) -> int:
        """The query's watermark delay (ms): the largest of the sources'."""
        from snapline.pipeline.time import duration_ms

        return max(
            duration_ms(src.max_out_of_orderness, "max_out_of_orderness") for src in self.sources
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
    pre = _resolved(pre, len(found))
    key_by: int | None = None
    keyed_roots: list[int] = []
    if found:
        key_by = found[0].id
        memo: dict[tuple[int, int], int] = {}
        keyed_roots = [_keyed_tree(pipeline, k, "pass", sinks, keyed, memo) for k in found]
        mixed = {s.node_id for s in pre} & {s.node_id for s in keyed}
        if mixed:
            by_id = {n.id: n for n in pipeline.nodes}
            unions = {i for i in mixed if by_id[i].kind == "union"} or mixed
            raise _refuse(
                f"{sorted(by_id[i].name for i in unions)}, which take streams from before and "
                "after key_by",
                "combine the streams before key_by, or key every one of them",
            )
    by_id = {n.id: n for n in pipeline.nodes}
    timed = [
        s
        for s in keyed
        if s.kind == "window" or (s.kind != "co_right" and _has_timers(by_id[s.node_id].fn))
    ]
    if len(timed) > 1:
        raise _refuse(
            f"{len(timed)} operators with timers ({[by_id[s.node_id].name for s in timed]})",
            "Spark keeps one set of timers per key, so one window or on_timer function per "
            "pipeline; split the pipeline or run it as services",
        )
    return StreamPlan(
        source=sources[0].fn,
        pre=tuple(pre),
        key_by=key_by,
        keyed=tuple(keyed),
        sinks=tuple(sinks),
        sources=tuple(n.fn for n in sources),
        roots=tuple(roots),
        key_bys=tuple(k.id for k in found),
        keyed_roots=tuple(keyed_roots),
        timed=timed[0].node_id if timed else None,
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


def _to_key_by(k: int) -> int:
    """In ``_pre_tree``'s steps until ``_resolved``: "on to the k-th key_by" (past the end
    of the part: ``len(pre) + k``)."""
    return -1 - k


def _pre_tree(
    pipeline: Pipeline,
    node: Node,
    kind: str,
    sinks: list[Sink],
    steps: list[Step],
    found: list[Node],
    visited: dict[int, int],
) -> int:
    """Append the part before ``key_by`` from ``node`` on, depth first; each key_by node goes
    into ``found`` once and its feeders' ``next`` name ``_to_key_by(its index there)``. A
    node reached again (a ``union``'s other input) keeps its first step: ``visited`` maps
    node ids to their steps."""
    if node.id in visited:
        return visited[node.id]
    index = len(steps)
    visited[node.id] = index
    children = []
    for child in _step(pipeline, node, kind, sinks, steps):
        if child.kind == "key_by":
            ids = [k.id for k in found]
            if child.id not in ids:
                found.append(child)
                ids.append(child.id)
            children.append(_to_key_by(ids.index(child.id)))
            continue
        _check_kind(child)
        children.append(_pre_tree(pipeline, child, child.kind, sinks, steps, found, visited))
    step = steps[index]
    steps[index] = Step(step.kind, step.node_id, step.sinks, tuple(children))
    return index


def _resolved(steps: list[Step], key_bys: int) -> list[Step]:
    """The part before ``key_by`` with ``_to_key_by(k)`` resolved to ``len(steps) + k``, past
    the part's end (where ``run_chain`` hands a value to ``emit_end(value, k)``)."""
    end = len(steps)
    ends = {_to_key_by(k): end + k for k in range(key_bys)}
    return [
        Step(s.kind, s.node_id, s.sinks, tuple(ends.get(j, j) for j in s.next or ())) for s in steps
    ]


def _keyed_tree(
    pipeline: Pipeline,
    node: Node,
    kind: str,
    sinks: list[Sink],
    steps: list[Step],
    visited: dict[tuple[int, int], int],
) -> int:
    """Append the keyed part from ``node`` on, depth first; ``node``'s index (its first one,
    for a node reached again through a ``union``). A co-process node has a step per side
    (``CO_SIDES``); the second shares the first's sinks and steps. ``visited`` maps (node id,
    side) to steps."""
    side = CO_SIDES.index(kind) if kind in CO_SIDES else 0
    if (node.id, side) in visited:
        return visited[(node.id, side)]
    other = visited.get((node.id, 1 - side)) if kind in CO_SIDES else None
    if other is not None:  # the other side's step is there: same outputs
        first = steps[other]
        visited[(node.id, side)] = len(steps)
        steps.append(Step(kind, node.id, first.sinks, first.next))
        return len(steps) - 1
    index = len(steps)
    visited[(node.id, side)] = index
    children = []
    for child in _step(pipeline, node, kind, sinks, steps):
        if child.kind == "key_by":
            raise _refuse(
                f"a second key_by after the first ({child.name!r}: a multi-stage pipeline)",
                "key_by once per stream on Spark streaming; run it as services or on "
                "Spark bounded (snapline spark run)",
            )
        _check_kind(child)
        child_kind = child.kind
        if child.kind == "co_process":
            if child.inputs[0].id == child.inputs[1].id:
                raise _refuse(
                    f"{child.name!r}, which connects a stream with itself",
                    "connect two different keyed streams",
                )
            child_kind = CO_SIDES[[i.id for i in child.inputs].index(node.id)]
        children.append(_keyed_tree(pipeline, child, child_kind, sinks, steps, visited))
    step = steps[index]
    steps[index] = Step(step.kind, step.node_id, step.sinks, tuple(children))
    return index


def _check_kind(node: Node) -> None:
    if node.kind == "union" and len({i.id for i in node.inputs}) < len(node.inputs):
        # A service task emits a record once per input it came in by; one step here, once.
        raise _refuse(
            f"the union {node.name!r} of a stream with itself",
            "union different streams (a stream twice emits each record twice as services)",
        )
    if node.kind == "process":
        _check_process(node.fn, node.name)
    elif node.kind not in ("window", "union", "co_process") and node.kind not in STATELESS:
        raise _refuse(f"the operator {node.name!r} ({node.kind})", "run it as services")


def _has_timers(fn: Any) -> bool:
    if isinstance(fn, KeyedCoProcessFunction):
        return type(fn).on_timer is not KeyedCoProcessFunction.on_timer
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
    emit_end: Callable[[Any, int], None] | None = None,
    start: int = 0,
    on_error: Callable[[int, Exception], None] | None = None,
) -> None:
    """Push ``value`` through step ``start`` and the steps after it (``functions[i]`` is step
    i's function, bound process function, or for a window a function from a value to the
    window's outputs): every output goes to the sinks of its step and on to the steps it feeds
    (``Step.next``, in order, depth first); what leaves the end of a chain goes to
    ``emit_end(value, k)`` when given: on to the k-th key_by (``StreamPlan.key_bys``).

    A step that raises: without ``on_error`` the exception ends the run. With it, as in a
    service task, only that step fails: ``on_error(step index, exception)`` is told, the
    outputs a generator yielded before raising are dropped (half a result beside a dead
    letter, as the services' process function and flat_map do not output), and every
    other branch runs."""
    end = len(steps)

    def push(i: int, v: Any) -> None:
        if i >= end:
            if emit_end is not None:
                emit_end(v, i - end)
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
            elif step.kind == "co_left":
                outs.extend(fn.process_left(v, ctx) or ())
            elif step.kind == "co_right":
                outs.extend(fn.process_right(v, ctx) or ())
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
