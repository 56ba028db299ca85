"""Watermarks of a task: per input channel, the minimum over the channels, idleness, and the
watermark records that carry a task's watermark across a repartition topic (DESIGN §7).

A watermark W says "no more records with event time <= W are expected". A source channel's is
``max timestamp seen - max_out_of_orderness - 1``; a repartition channel's is the minimum over
the upstream tasks that write to it (each sends ``WatermarkRecord``s inside its transaction).
A source channel with nothing to read for ``idle_timeout`` seconds, whose partition Kafka
says is read to its end (``AtEnd``: runtime/source_ends.py), is idle and does not hold the
task back; an upstream task whose inputs are all idle says so in its watermark record. The
task's watermark is the minimum over its active channels and never goes backwards, across
restores too: ``TaskClock.snapshot`` travels in the task's checkpoint metadata. When every
channel is idle, the watermark moves to the largest of theirs (as Flink's watermark valve
does), so the windows of the data that did arrive close.

A task restored from a savepoint with another task count takes key-groups from several old
tasks and starts at the smallest of their watermarks (their records in flight are replayed to
it). The key-groups of the old tasks that were further keep their watermark as a *floor*
(``TaskClock.floors``, key-group -> watermark): keyed operators judge lateness and fire on the
larger of the two, so a window that fired or was purged there is neither updated unseen nor
fired again. A floor goes once the task's watermark reaches it, and travels in the snapshot
until then.

Pure logic; the task thread owns a clock (``now`` is ``time.monotonic()``, passed in).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

#: Before any record: every event time is still to come.
MIN_WATERMARK = -(1 << 63)
#: The end of time: every event-time timer fires (the end of a bounded input).
MAX_WATERMARK = (1 << 63) - 1
#: The Kafka key of a watermark record starts with this byte (data records start with s/b/j).
WATERMARK_KEY_TAG = b"w"

TopicPartitionKey = tuple[str, int]
#: Whether a source partition is read to its end in Kafka, given when it last had a record
#: (an answer to a question asked before that is stale): True, False (records wait, or it
#: cannot tell), None (the answer is on its way). None as a whole: no Kafka, nothing local
#: means nothing to read.
AtEnd = Callable[[TopicPartitionKey, float], bool | None] | None


@dataclass(frozen=True)
class WatermarkRecord:
    """A control record in a repartition topic: ``writer``'s watermark and idleness."""

    writer: str
    watermark: int
    idle: bool

    def key(self) -> bytes:
        return WATERMARK_KEY_TAG + self.writer.encode()

    def value(self) -> bytes:
        return orjson.dumps({"w": self.watermark, "i": self.idle})

    @staticmethod
    def is_watermark_key(raw_key: bytes | None) -> bool:
        return raw_key is not None and raw_key[:1] == WATERMARK_KEY_TAG

    @staticmethod
    def decode(raw_key: bytes, raw_value: bytes) -> WatermarkRecord:
        data = orjson.loads(raw_value)
        return WatermarkRecord(raw_key[1:].decode(), int(data["w"]), bool(data["i"]))


class SourceChannelClock:
    """Bounded out-of-orderness over one source partition's record timestamps."""

    def __init__(
        self,
        out_of_orderness: int,
        idle_timeout: float | None,
        now: float,
        tp: TopicPartitionKey = ("", -1),
    ) -> None:
        self.out_of_orderness = out_of_orderness
        self.idle_timeout = idle_timeout
        self.tp = tp
        self.max_timestamp = MIN_WATERMARK
        self.last_active = now
        #: Kafka said the partition was read to its end since the last record.
        self.at_end = False
        #: When Kafka last said so: asked again every ``idle_timeout`` while idle.
        self._end_confirmed = now

    def observe(self, max_timestamp: int | None, now: float) -> None:
        self.last_active = now
        self.at_end = False
        if max_timestamp is not None and max_timestamp > self.max_timestamp:
            self.max_timestamp = max_timestamp

    def watermark(self) -> int:
        if self.max_timestamp == MIN_WATERMARK:
            return MIN_WATERMARK
        return self.max_timestamp - self.out_of_orderness - 1

    def idle(self, now: float, backlog: bool, at_end: AtEnd = None) -> bool:
        """Nothing to process for ``idle_timeout`` seconds and, when ``at_end`` can ask
        Kafka, nothing waiting there either. Records waiting (or no way to tell) restart the
        timeout: a partition the consumer is not reading (paused for a savepoint, restoring,
        cut off from the broker) is not idle while its backlog waits."""
        timeout = self.idle_timeout
        if timeout is None or backlog or now - self.last_active < timeout:
            return False
        if at_end is None:
            return True
        if self.at_end:
            # Idle, and asked again every timeout: records can come to wait here without a
            # record being read (the consumer paused for a savepoint while they arrived), and
            # an idle partition would let the others' records make them late when it resumes.
            if now - self._end_confirmed < timeout:
                return True
            answer = at_end(self.tp, self._end_confirmed)
            if answer is None:  # on its way: idle as last known
                return True
            if answer:
                self._end_confirmed = now
                return True
            self.at_end = False
            self.last_active = now
            return False
        answer = at_end(self.tp, self.last_active)
        if answer is None:
            return False
        if answer:
            self.at_end = True
            self._end_confirmed = now
            return True
        self.last_active = now
        return False

    def snapshot(self) -> dict[str, Any]:
        return {"max": self.max_timestamp}

    def restore(self, data: Mapping[str, Any]) -> None:
        self.max_timestamp = int(data.get("max", MIN_WATERMARK))


class UpstreamChannelClock:
    """One repartition partition: the minimum over the upstream tasks' (``writers``, their
    task ids) watermarks, unknown until every one of them has sent one, excluding the idle
    ones. Records of other writers (tasks of an earlier parallelism) are ignored."""

    def __init__(self, writers: frozenset[str]) -> None:
        self.writers = writers
        self.latest: dict[str, tuple[int, bool]] = {}

    def update(self, record: WatermarkRecord) -> None:
        if record.writer not in self.writers:
            return
        previous = self.latest.get(record.writer)
        watermark = record.watermark if previous is None else max(previous[0], record.watermark)
        self.latest[record.writer] = (watermark, record.idle)

    def watermark(self) -> int:
        if len(self.latest) < len(self.writers):
            return MIN_WATERMARK
        active = [w for w, idle in self.latest.values() if not idle]
        return min(active) if active else max(w for w, _ in self.latest.values())

    def idle(self, now: float, backlog: bool, at_end: AtEnd = None) -> bool:
        return (
            not backlog
            and len(self.latest) >= len(self.writers)
            and all(idle for _, idle in self.latest.values())
        )

    def snapshot(self) -> dict[str, Any]:
        return {"up": {w: [wm, idle] for w, (wm, idle) in sorted(self.latest.items())}}

    def restore(self, data: Mapping[str, Any]) -> None:
        self.latest = {
            w: (int(wm), bool(idle))
            for w, (wm, idle) in data.get("up", {}).items()
            if w in self.writers
        }


ChannelClock = SourceChannelClock | UpstreamChannelClock


class TaskClock:
    """The watermark of a task: the minimum over its active channels, never decreasing."""

    def __init__(self, channels: Mapping[TopicPartitionKey, ChannelClock]) -> None:
        self.channels = dict(channels)
        self.watermark = MIN_WATERMARK
        self.idle = False
        #: Key-group -> watermark above ``watermark`` (see the module docstring); empty but
        #: after a rescale.
        self.floors: dict[int, int] = {}

    def observe(self, tp: TopicPartitionKey, max_timestamp: int | None, now: float) -> None:
        clock = self.channels[tp]
        if isinstance(clock, SourceChannelClock):
            clock.observe(max_timestamp, now)

    def upstream(self, tp: TopicPartitionKey, record: WatermarkRecord) -> None:
        clock = self.channels[tp]
        if isinstance(clock, UpstreamChannelClock):
            clock.update(record)

    def advance(
        self, now: float, backlog: Mapping[TopicPartitionKey, bool], at_end: AtEnd = None
    ) -> bool:
        """Recompute; True if the watermark moved forward."""
        active = [
            clock.watermark()
            for tp, clock in self.channels.items()
            if not clock.idle(now, backlog.get(tp, False), at_end)
        ]
        self.idle = not active
        if active:
            candidate = min(active)
        elif self.channels:  # all idle: what did arrive may close its windows
            candidate = max(clock.watermark() for clock in self.channels.values())
        else:
            return False
        if candidate > self.watermark:
            self.watermark = candidate
            if self.floors:
                self.floors = {g: w for g, w in self.floors.items() if w > candidate}
            return True
        return False

    def end_of_input(self) -> None:
        """Every input ended (a bounded run): all event time has passed."""
        self.watermark = MAX_WATERMARK
        self.floors = {}

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "watermark": self.watermark,
            "channels": [[t, p, c.snapshot()] for (t, p), c in sorted(self.channels.items())],
        }
        if self.floors:
            out["floors"] = encode_floors(self.floors)
        return out

    def restore(self, data: Mapping[str, Any] | None) -> None:
        """Continue from a checkpoint's clock: never before its watermark."""
        if not data:
            return
        self.watermark = max(self.watermark, int(data.get("watermark", MIN_WATERMARK)))
        floors = {**self.floors, **decode_floors(data.get("floors", []))}
        self.floors = {g: w for g, w in floors.items() if w > self.watermark}
        for topic, partition, state in data.get("channels", []):
            clock = self.channels.get((topic, int(partition)))
            if clock is not None:
                clock.restore(state)


def encode_floors(floors: Mapping[int, int]) -> list[list[int]]:
    """Key-group floors as ``[first group, last group, watermark]`` runs (JSON)."""
    runs: list[list[int]] = []
    for group in sorted(floors):
        mark = floors[group]
        if runs and runs[-1][1] == group - 1 and runs[-1][2] == mark:
            runs[-1][1] = group
        else:
            runs.append([group, group, mark])
    return runs


def decode_floors(runs: Any) -> dict[int, int]:
    return {
        group: int(mark) for first, last, mark in runs for group in range(int(first), int(last) + 1)
    }


def with_floors(
    watermark: int, floors: Mapping[int, int], records: list[Any]
) -> list[tuple[int, list[Any]]]:
    """``records`` (with ``key_group``) in their order, cut into runs that share a watermark:
    the larger of ``watermark`` and their key-group's floor."""
    runs: list[tuple[int, list[Any]]] = []
    for r in records:
        mark = max(floors.get(r.key_group, watermark), watermark)
        if runs and runs[-1][0] == mark:
            runs[-1][1].append(r)
        else:
            runs.append((mark, [r]))
    return runs
