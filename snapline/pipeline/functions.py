"""User-facing function types: the keyed process function and the context it receives."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from snapline.pipeline.runtime.timers import TimerService


class Context:
    """What a keyed process function knows about the record it is processing.

    One object per task, refreshed before each record; do not keep it past ``process``.
    ``timestamp`` is the record's event time (ms); ``watermark`` the task's current watermark;
    ``timers`` registers and deletes timers of the current key (see ``TimerService``). In
    ``on_timer``, ``timestamp`` is the timer's time and ``time_domain`` says which kind fired.
    """

    __slots__ = (
        "key",
        "timestamp",
        "topic",
        "partition",
        "offset",
        "task_id",
        "timers",
        "watermark",
        "time_domain",
    )

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.key: Any = None
        self.timestamp = 0
        self.topic = ""
        self.partition = -1
        self.offset = -1
        self.timers: TimerService | None = None
        self.watermark = -(1 << 63)
        #: "event" or "processing" in ``on_timer``; None in ``process``.
        self.time_domain: str | None = None

    @property
    def position(self) -> tuple[str, int, int]:
        """The record's source position: (topic, partition, offset)."""
        return (self.topic, self.partition, self.offset)


class KeyedProcessFunction:
    """A function applied after ``key_by``; declares keyed state as class attributes.

    Example::

        class RunningTotal(KeyedProcessFunction):
            total = ValueState("total", default=0)

            def process(self, value, ctx):
                t = self.total.value() + value["amount"]
                self.total.update(t)
                yield {"customer": ctx.key, "total": t}

    ``process`` returns an iterable of outputs (a generator, a list) or None for no output.
    Each task gets its own copy of the function object, bound to that task's state.
    """

    def open(self, task_id: str) -> None:
        """Called once per task before the first record (after state is restored)."""

    def process(self, value: Any, ctx: Context) -> Iterable[Any] | None:
        raise NotImplementedError(f"{type(self).__name__} must implement process(value, ctx)")

    def on_timer(self, timestamp: int, ctx: Context) -> Iterable[Any] | None:
        """A timer of ``ctx.key`` registered through ``ctx.timers`` fired (once per
        registration): event-time timers when the watermark reaches ``timestamp``,
        processing-time timers when the wall clock does. Returns outputs like ``process``."""
        raise NotImplementedError(
            f"{type(self).__name__} registered a timer but does not implement "
            "on_timer(timestamp, ctx)"
        )

    def close(self) -> None:
        """Called when the task goes away."""


class KeyedCoProcessFunction:
    """A function over two connected keyed streams (``left.connect(right).process(fn)``):
    records of either side with the same key see the same keyed state, declared as class
    attributes like a ``KeyedProcessFunction``'s. The building block of enrichment and joins.

    Example (orders enriched with the latest customer profile)::

        class Enrich(KeyedCoProcessFunction):
            profile = ValueState("profile")

            def process_left(self, order, ctx):          # an order
                yield {**order, "tier": (self.profile.value() or {}).get("tier")}

            def process_right(self, profile, ctx):       # a customer profile update
                self.profile.update(profile)

    Both methods return an iterable of outputs or None. The order between the two sides is
    the order in which the task reads them; within one side it is the input order.
    """

    def open(self, task_id: str) -> None:
        """Called once per task before the first record (after state is restored)."""

    def process_left(self, value: Any, ctx: Context) -> Iterable[Any] | None:
        raise NotImplementedError(f"{type(self).__name__} must implement process_left(value, ctx)")

    def process_right(self, value: Any, ctx: Context) -> Iterable[Any] | None:
        raise NotImplementedError(f"{type(self).__name__} must implement process_right(value, ctx)")

    def on_timer(self, timestamp: int, ctx: Context) -> Iterable[Any] | None:
        """A timer of ``ctx.key`` registered through ``ctx.timers`` fired (once per
        registration): event-time timers when the watermark reaches ``timestamp``,
        processing-time timers when the wall clock does. Returns outputs like ``process``."""
        raise NotImplementedError(
            f"{type(self).__name__} registered a timer but does not implement "
            "on_timer(timestamp, ctx)"
        )

    def close(self) -> None:
        """Called when the task goes away."""
