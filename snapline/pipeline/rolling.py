"""Rolling aggregations of a keyed stream: ``count()``, ``reduce(fn)``, ``aggregate(fn)``.

Not windowed: each key's accumulator lives in keyed state for good, and every record emits the
key's updated result as ``{"key": key, "value": result}`` (Flink's rolling ``reduce``, Kafka
Streams' ``groupByKey().aggregate()``). The accumulator is one ``ValueState`` named ``acc``,
so savepoints (state as data under ``<savepoint>/operators/<uid>``) and the Spark runners see
it like any process function's state.

``RollingAggregate`` is a ``KeyedProcessFunction``: that is its meaning everywhere (the Spark
runners run it as one). The service runtime runs it with ``RollingAggregateOperator``
(runtime/operators.py), which keeps the same state and emits the same records without the
per-record machinery of a process function.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.functions import Context, KeyedProcessFunction
from snapline.pipeline.state.descriptors import AggregateFunction, StateDescriptor, ValueState
from snapline.pipeline.state.serde import Serde

#: The name of the accumulator's state (as savepoints show it).
STATE_NAME = "acc"


def _count(value: Any, acc: int) -> int:
    return acc + 1


class RollingAggregate(KeyedProcessFunction):
    """The function behind ``KeyedStream.count/reduce/aggregate`` (see module docstring).

    A key's first record starts its accumulator at ``create()`` (with ``create`` None: the
    record's value is the accumulator, as in Flink's rolling reduce); each record then folds in
    with ``add(value, acc)`` (``value_first``, an ``AggregateFunction``'s order) or
    ``add(acc, value)`` (a reduce function's). ``result`` maps the accumulator to the emitted
    value (None: the accumulator itself). An accumulator of None cannot be stored: a function
    that returns None sends the record to the dead letters and leaves the key's state as it
    was. ``ttl`` (seconds or timedelta, processing time): a key's accumulator expires that
    long after its last update, and the key's next record starts again from ``create()``
    (``ValueState``'s TTL)."""

    def __init__(
        self,
        what: str,
        create: Callable[[], Any] | None,
        add: Callable[[Any, Any], Any],
        value_first: bool,
        result: Callable[[Any], Any] | None,
        serde: Serde | str | None = None,
        ttl: float | timedelta | None = None,
    ) -> None:
        self.what = what
        self.create = create
        self.add = add
        self.value_first = value_first
        self.result = result
        self.descriptor: ValueState[Any] = ValueState(STATE_NAME, serde=serde, ttl=ttl)
        self.descriptor.attribute = STATE_NAME
        self.acc: Any = None  # the bound ValueState, set per task by the runtime

    def states(self) -> list[StateDescriptor]:
        return [self.descriptor]

    def fold(self, acc: Any, value: Any) -> Any:
        """The accumulator after ``value`` (``acc``: None for the key's first record)."""
        if acc is None:
            if self.create is None:
                return value
            acc = self.create()
        return self.add(value, acc) if self.value_first else self.add(acc, value)

    def process(self, value: Any, ctx: Context) -> Iterable[Any]:
        # The output before the state: a record whose result raises leaves no trace in state.
        acc = self.fold(self.acc.value(), value)
        if acc is None:
            raise returned_none(self.what, ctx.key)
        out = {"key": ctx.key, "value": acc if self.result is None else self.result(acc)}
        self.acc.update(acc)
        return (out,)


def returned_none(what: str, key: Any) -> ValueError:
    return ValueError(f"{what}: the function returned None for key {key!r}")


def rolling_count(ttl: float | timedelta | None = None) -> RollingAggregate:
    return RollingAggregate("count", int, _count, True, None, ttl=ttl)


def rolling_reduce(
    fn: Callable[[Any, Any], Any], ttl: float | timedelta | None = None
) -> RollingAggregate:
    if not callable(fn):
        raise ConfigurationError(f"reduce() needs a function of two values, got {fn!r}")
    return RollingAggregate("reduce", None, fn, False, None, ttl=ttl)


def rolling_aggregate(
    function: AggregateFunction[Any, Any, Any],
    serde: Serde | str | None,
    ttl: float | timedelta | None = None,
) -> RollingAggregate:
    if not isinstance(function, AggregateFunction):
        raise ConfigurationError(
            f"aggregate() needs an AggregateFunction instance, got {function!r}"
        )
    return RollingAggregate(
        "aggregate",
        function.create_accumulator,
        function.add,
        True,
        function.get_result,
        serde,
        ttl,
    )
