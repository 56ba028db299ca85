"""Windows on keyed streams (DESIGN §7): which windows a record belongs to, and what is
computed per window. ``KeyedStream.window(assigner)`` returns a ``WindowedStream``; its
``reduce``, ``aggregate`` or ``count`` returns the stream of window results, each a dict
``{"key", "start", "end", "value"}`` (``start`` inclusive, ``end`` exclusive, ms), emitted
once the watermark passes the window's end (docs/time.md).

Pure declarations; the runtime's ``WindowOperator`` runs them on timers and keyed state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.state.descriptors import AggregateFunction, MapState, StateDescriptor
from snapline.pipeline.state.serde import Serde
from snapline.pipeline.time import duration_ms

if TYPE_CHECKING:
    from snapline.pipeline.graph import KeyedStream

ON_LATE = ("dead_letter", "drop")


# ---------------------------------------------------------------- assigners
class WindowAssigner(ABC):
    """Which windows a record with event time ``ts`` belongs to."""

    kind = "abstract"

    @abstractmethod
    def describe(self) -> str: ...


@dataclass(frozen=True)
class TumblingWindows(WindowAssigner):
    """Fixed, non-overlapping windows of ``size`` ms: [k*size + offset, (k+1)*size + offset)."""

    size: int
    offset: int = 0
    kind = "tumbling"

    def assign(self, ts: int) -> list[tuple[int, int]]:
        start = ts - (ts - self.offset) % self.size
        return [(start, start + self.size)]

    def describe(self) -> str:
        return f"tumbling({self.size} ms)"


@dataclass(frozen=True)
class HoppingWindows(WindowAssigner):
    """Windows of ``size`` ms starting every ``step`` ms (overlapping when step < size)."""

    size: int
    step: int
    offset: int = 0
    kind = "hopping"

    def assign(self, ts: int) -> list[tuple[int, int]]:
        last = ts - (ts - self.offset) % self.step
        windows = []
        start = last
        while start > ts - self.size:
            windows.append((start, start + self.size))
            start -= self.step
        return windows[::-1]

    def describe(self) -> str:
        return f"hopping({self.size} ms every {self.step} ms)"


@dataclass(frozen=True)
class SlidingWindows(WindowAssigner):
    """One window per distinct record timestamp t of a key: the ``size`` ms ending at t,
    [t - size + 1, t + 1), over every record of the key in it (Kafka Streams' and Quix'
    sliding windows)."""

    size: int
    kind = "sliding"

    def describe(self) -> str:
        return f"sliding({self.size} ms)"


@dataclass(frozen=True)
class SessionWindows(WindowAssigner):
    """Per key, records closer than ``gap`` ms (or exactly ``gap``) form one session
    [first ts, last ts + gap); sessions merge when a record bridges them."""

    gap: int
    kind = "session"

    def describe(self) -> str:
        return f"session(gap {self.gap} ms)"


def tumbling(size: int | timedelta, *, offset: int | timedelta = 0) -> TumblingWindows:
    """Tumbling windows of ``size`` (ms or timedelta)."""
    size_ms = duration_ms(size, "tumbling size", minimum=1)
    return TumblingWindows(size_ms, duration_ms(offset, "offset") % size_ms)


def hopping(size: int | timedelta, step: int | timedelta) -> HoppingWindows:
    """Windows of ``size`` starting every ``step`` (ms or timedelta); ``step <= size``."""
    size_ms = duration_ms(size, "hopping size", minimum=1)
    step_ms = duration_ms(step, "hopping step", minimum=1)
    if step_ms > size_ms:
        raise ConfigurationError(
            f"hopping step {step_ms} ms is larger than the size {size_ms} ms: records between "
            "windows would belong to none; use a step <= size"
        )
    return HoppingWindows(size_ms, step_ms)


def sliding(size: int | timedelta) -> SlidingWindows:
    """Per-record sliding windows of ``size`` (ms or timedelta)."""
    return SlidingWindows(duration_ms(size, "sliding size", minimum=1))


def session(gap: int | timedelta) -> SessionWindows:
    """Session windows closed by ``gap`` (ms or timedelta) without records of the key."""
    return SessionWindows(duration_ms(gap, "session gap", minimum=1))


# ---------------------------------------------------------------- aggregations
class Aggregation(ABC):
    """What a window computes, as an accumulator (stored in keyed state, serde-encoded)."""

    @abstractmethod
    def create(self) -> Any: ...

    @abstractmethod
    def add(self, acc: Any, value: Any) -> Any: ...

    @abstractmethod
    def merge(self, a: Any, b: Any) -> Any: ...

    @abstractmethod
    def result(self, acc: Any) -> Any: ...


class CountAggregation(Aggregation):
    def create(self) -> int:
        return 0

    def add(self, acc: int, value: Any) -> int:
        return acc + 1

    def merge(self, a: int, b: int) -> int:
        return a + b

    def result(self, acc: int) -> int:
        return acc


class ReduceAggregation(Aggregation):
    """``fn(a, b)`` folds values; the accumulator is ``[]`` or ``[value]``."""

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        self.fn = fn

    def create(self) -> list[Any]:
        return []

    def add(self, acc: list[Any], value: Any) -> list[Any]:
        return [self.fn(acc[0], value)] if acc else [value]

    def merge(self, a: list[Any], b: list[Any]) -> list[Any]:
        if not a or not b:
            return a or b
        return [self.fn(a[0], b[0])]

    def result(self, acc: list[Any]) -> Any:
        return acc[0] if acc else None


class FunctionAggregation(Aggregation):
    """A user's ``AggregateFunction`` (session windows need its ``merge``)."""

    def __init__(self, function: AggregateFunction[Any, Any, Any]) -> None:
        self.function = function

    def create(self) -> Any:
        return self.function.create_accumulator()

    def add(self, acc: Any, value: Any) -> Any:
        return self.function.add(value, acc)

    def merge(self, a: Any, b: Any) -> Any:
        return self.function.merge(a, b)

    def result(self, acc: Any) -> Any:
        return self.function.get_result(acc)


@dataclass(frozen=True)
class WindowSpec:
    """A window node of the graph: assigner, aggregation and lateness policy."""

    assigner: WindowAssigner
    aggregation: Aggregation
    allowed_lateness: int
    on_late: str
    serde: Serde | str | None = None

    def states(self) -> list[StateDescriptor]:
        """The keyed state the window operator keeps (timers are added by the pipeline)."""
        if isinstance(self.assigner, SlidingWindows):
            # Per record timestamp, the values at it: windows are computed when they fire.
            return [MapState("buckets", serde=self.serde)]
        return [MapState("windows", serde=self.serde)]


class WindowedStream:
    """A keyed stream cut into windows; ``reduce``, ``aggregate`` or ``count`` finishes it."""

    def __init__(
        self,
        stream: KeyedStream,
        assigner: WindowAssigner,
        allowed_lateness: int,
        on_late: str,
        name: str,
    ) -> None:
        self._stream = stream
        self._assigner = assigner
        self._lateness = allowed_lateness
        self._on_late = on_late
        self._name = name

    def _finish(
        self, aggregation: Aggregation, what: str, serde: Serde | str | None = None
    ) -> KeyedStream:
        spec = WindowSpec(self._assigner, aggregation, self._lateness, self._on_late, serde)
        name = self._name or f"window-{what}:{self._assigner.describe()}"
        return self._stream._window_node(spec, name)

    def count(self) -> KeyedStream:
        """The number of records per window."""
        return self._finish(CountAggregation(), "count")

    def reduce(self, fn: Callable[[Any, Any], Any]) -> KeyedStream:
        """The values of each window folded with ``fn(a, b)`` (in arrival order)."""
        if not callable(fn):
            raise ConfigurationError(f"reduce() needs a function of two values, got {fn!r}")
        return self._finish(ReduceAggregation(fn), "reduce")

    def aggregate(
        self, function: AggregateFunction[Any, Any, Any], *, serde: Serde | str | None = None
    ) -> KeyedStream:
        """``function``'s result per window (create_accumulator/add/merge/get_result); the
        accumulator is stored with ``serde`` (JSON by default). Session windows call
        ``merge`` when sessions merge."""
        if not isinstance(function, AggregateFunction):
            raise ConfigurationError(
                f"aggregate() needs an AggregateFunction instance, got {function!r}"
            )
        return self._finish(FunctionAggregation(function), "aggregate", serde)


def check_window_args(allowed_lateness: Any, on_late: str) -> int:
    if on_late not in ON_LATE:
        raise ConfigurationError(f"on_late={on_late!r}; use one of {list(ON_LATE)}")
    return duration_ms(allowed_lateness, "allowed_lateness")
