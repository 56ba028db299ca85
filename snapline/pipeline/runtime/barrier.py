"""Checkpoint barriers and their alignment at a task's inputs.

A ``Barrier(n)`` is placed in every input channel of a task when checkpoint n is triggered,
right behind the last record read from that channel's partition. ``BarrierAligner`` decides,
for each channel event, whether the task may keep reading the channel:

- exactly-once: a channel that delivered barrier n is *blocked* until every channel did;
  then the barrier is released downstream and all channels unblock (Flink's alignment);
- at-least-once: channels are never blocked; the barrier is released when the last channel
  delivered it, so records read past the barrier on a fast channel end up in checkpoint n
  and are replayed after a failure (duplicates, never loss).

Pure logic, no I/O: the task thread owns an aligner.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Barrier:
    """Marker of checkpoint ``checkpoint_id``: everything before it belongs to that checkpoint."""

    checkpoint_id: int


class BarrierAligner:
    """Tracks which channels delivered the current barrier."""

    def __init__(self, channels: Iterable[Hashable], *, exactly_once: bool = True) -> None:
        self._channels = set(channels)
        self._exactly_once = exactly_once
        self._current: int | None = None
        self._arrived: set[Hashable] = set()
        #: How many times a channel was held back for alignment (a metric and a test hook).
        self.blocked_count = 0

    @property
    def pending_checkpoint(self) -> int | None:
        return self._current

    def is_blocked(self, channel: Hashable) -> bool:
        """May the task read the next item of ``channel``?"""
        return self._exactly_once and channel in self._arrived

    def add_channel(self, channel: Hashable) -> None:
        self._channels.add(channel)

    def on_barrier(self, channel: Hashable, barrier: Barrier) -> Barrier | None:
        """Record that ``channel`` delivered ``barrier``; return it once all channels did."""
        if channel not in self._channels:
            raise ValueError(f"barrier from unknown channel {channel!r}")
        if self._current is None:
            self._current = barrier.checkpoint_id
        elif barrier.checkpoint_id != self._current:
            raise ValueError(
                f"barrier {barrier.checkpoint_id} on {channel!r} while aligning {self._current}"
            )
        if channel in self._arrived:
            raise ValueError(f"channel {channel!r} delivered barrier {barrier.checkpoint_id} twice")
        self._arrived.add(channel)
        if self._arrived >= self._channels:
            self._current = None
            self._arrived = set()
            return barrier
        if self._exactly_once:
            self.blocked_count += 1
        return None
