"""What ``snapline spark stream`` runs: the declared graph checked and cut into the two parts
of a Structured Streaming query, or a ConfigurationError at start naming what cannot map.

A supported pipeline is one Kafka source, a chain of stateless operators, at most one
``key_by`` and after it a chain of keyed process functions and stateless operators, with sinks
hanging off any operator of the last chain (or of the only chain, without ``key_by``):

    source → (map | filter | flat_map)* → key_by → (process | window | map | filter | flat_map)*

The part before ``key_by`` runs per micro-batch on the executors; the part after it runs per
key through ``transformWithState``. At most one operator of it may use event-time timers (a
window, or a process function implementing ``on_timer``): Spark keeps one set of timers per
key. ``run_chain`` pushes one value through a part.
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
    """One operator of a chain and the sinks (indexes into ``StreamPlan.sinks``) its output
    feeds."""

    kind: str
    node_id: int
    sinks: tuple[int, ...] = ()


@dataclass(frozen=True)
class StreamPlan:
    source: KafkaSource
    #: Before ``key_by`` (starts with the source's "pass" step).
    pre: tuple[Step, ...]
    #: The ``key_by`` node id, or None for a pipeline without keyed state.
    key_by: int | None
    #: After ``key_by`` (starts with its "pass" step); empty without ``key_by``.
    keyed: tuple[Step, ...]
    sinks: tuple[Sink, ...]
    #: The one keyed operator with event-time timers (a window, or a process function that
    #: implements on_timer), or None: the query then runs without event time.
    timed: int | None = None

    @property
    def process_ids(self) -> tuple[int, ...]:
        return tuple(s.node_id for s in self.keyed if s.kind == "process")


def _refuse(what: str, fix: str) -> ConfigurationError:
    return ConfigurationError(f"snapline spark stream cannot run {what} yet: {fix}")


def plan_stream(pipeline: Pipeline) -> StreamPlan:
    """Check ``pipeline`` for the streaming runner (see module); ConfigurationError if any part
    cannot map onto a Structured Streaming query."""
    pipeline.validate()
    if not pipeline.exactly_once:
        raise ConfigurationError("snapline spark stream needs guarantee='exactly_once'")
    sources = [n for n in pipeline.nodes if n.kind == "source"]
    if len(sources) != 1:
        raise _refuse(
            f"{len(sources)} sources",
            "read several topics with one KafkaSource((...)) instead of a union, or run the "
            "pipeline as services (snapline run)",
        )
    sinks: list[Sink] = []
    pre: list[Step] = []
    keyed: list[Step] = []
    key_by: int | None = None
    node: Node = sources[0]
    kind = "pass"
    while True:
        below = pipeline.downstream(node)
        sink_nodes = [n for n in below if n.kind == "sink"]
        indexes = tuple(range(len(sinks), len(sinks) + len(sink_nodes)))
        sinks.extend(n.fn for n in sink_nodes)
        (keyed if key_by is not None else pre).append(Step(kind, node.id, indexes))
        rest = [n for n in below if n.kind != "sink"]
        if not rest:
            break
        if len(rest) > 1:
            raise _refuse(
                f"a branching graph ({node.name!r} feeds {[n.name for n in rest]})",
                "give each branch its own pipeline, or run it as services",
            )
        node = rest[0]
        kind = node.kind
        if kind == "key_by":
            if key_by is not None:
                raise _refuse(
                    f"a second key_by ({node.name!r}: a multi-stage pipeline)",
                    "one key_by per pipeline on Spark streaming; run it as services or on "
                    "Spark bounded (snapline spark run)",
                )
            key_by = node.id
            kind = "pass"
        elif kind == "process":
            _check_process(node.fn, node.name)
        elif kind != "window" and kind not in STATELESS:
            raise _refuse(f"the operator {node.name!r} ({kind})", "run it as services")
    if key_by is not None and any(s.sinks for s in pre):
        raise _refuse(
            "a sink before key_by",
            "sinks may only follow the keyed part; put the sink after key_by(...)",
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
    )


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
) -> None:
    """Push ``value`` through ``steps[start:]`` (``functions[i]`` is step i's function, bound
    process function, or for a window a function from a value to the window's outputs): every
    output goes to the sinks of its step and on to the next step; what leaves the last step
    goes to ``emit_end`` (the key_by) when given."""

    def push(i: int, v: Any) -> None:
        if i == len(steps):
            if emit_end is not None:
                emit_end(v)
            return
        step = steps[i]
        fn = functions[i]
        outs: Any
        if step.kind == "pass":
            outs = (v,)
        elif step.kind == "map":
            outs = (fn(v),)
        elif step.kind == "filter":
            outs = (v,) if fn(v) else ()
        elif step.kind in ("flat_map", "window"):
            outs = fn(v) or ()
        else:
            outs = fn.process(v, ctx) or ()
        for out in outs:
            for sink in step.sinks:
                emit_sink(sink, out)
            push(i + 1, out)

    push(start, value)
