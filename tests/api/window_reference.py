"""A brute-force reference for windows: per record, in arrival order, the watermark a single
partition gives (largest timestamp so far - out-of-orderness - 1), plain dicts and lists, no
timers, no state backend. What the window operator must emit, window by window."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

MIN = -(1 << 63)
Window = tuple[Any, int, int]  # key, start, end
Event = tuple[Any, int, Any]  # key, timestamp, value


class Reference:
    def __init__(self, fold: Callable[[list[Any]], Any], lateness: int) -> None:
        self.fold = fold
        self.lateness = lateness
        self.watermark = MIN
        self.emitted: dict[Window, list[Any]] = defaultdict(list)
        self.late: list[Event] = []

    def run(self, events: list[Event], out_of_orderness: int) -> Reference:
        max_ts = MIN
        for event in events:
            self.add(event)
            max_ts = max(max_ts, event[1])
            candidate = max_ts - out_of_orderness - 1
            if candidate > self.watermark:
                self.advance(candidate)
        self.advance((1 << 63) - 1)
        return self

    def add(self, event: Event) -> None:
        raise NotImplementedError

    def advance(self, watermark: int) -> None:
        raise NotImplementedError


class FixedReference(Reference):
    """Tumbling and hopping windows: ``assign(ts)`` lists the (start, end) of a timestamp."""

    def __init__(
        self,
        assign: Callable[[int], list[tuple[int, int]]],
        fold: Callable[[list[Any]], Any],
        lateness: int,
    ) -> None:
        super().__init__(fold, lateness)
        self.assign = assign
        self.windows: dict[Window, list[Any]] = {}

    def add(self, event: Event) -> None:
        key, ts, value = event
        accepted = [(s, e) for s, e in self.assign(ts) if e - 1 + self.lateness > self.watermark]
        if not accepted:
            self.late.append(event)
        for s, e in accepted:
            values = self.windows.setdefault((key, s, e), [])
            values.append(value)
            if e - 1 <= self.watermark:
                self.emitted[(key, s, e)].append(self.fold(values))

    def advance(self, watermark: int) -> None:
        for window in sorted(self.windows, key=lambda w: w[2]):
            if self.watermark < window[2] - 1 <= watermark:
                self.emitted[window].append(self.fold(self.windows[window]))
        for window in [w for w in self.windows if w[2] - 1 + self.lateness <= watermark]:
            del self.windows[window]
        self.watermark = watermark


class SessionReference(Reference):
    def __init__(self, gap: int, fold: Callable[[list[Any]], Any], lateness: int) -> None:
        super().__init__(fold, lateness)
        self.gap = gap
        self.sessions: dict[Window, list[Any]] = {}

    def add(self, event: Event) -> None:
        key, ts, value = event
        start, end = ts, ts + self.gap
        touching = [w for w in self.sessions if w[0] == key and w[1] <= end and start <= w[2]]
        new_start = min([start, *(w[1] for w in touching)])
        new_end = max([end, *(w[2] for w in touching)])
        if new_end - 1 + self.lateness <= self.watermark:
            self.late.append(event)
            return
        values = [value]
        for w in touching:
            values += self.sessions.pop(w)
        self.sessions[(key, new_start, new_end)] = values
        if new_end - 1 <= self.watermark:
            self.emitted[(key, new_start, new_end)].append(self.fold(values))

    def advance(self, watermark: int) -> None:
        for window in sorted(self.sessions, key=lambda w: w[2]):
            if self.watermark < window[2] - 1 <= watermark:
                self.emitted[window].append(self.fold(self.sessions[window]))
        for window in [w for w in self.sessions if w[2] - 1 + self.lateness <= watermark]:
            del self.sessions[window]
        self.watermark = watermark


class SlidingReference(Reference):
    """One window per distinct timestamp t of a key: (t - size, t]."""

    def __init__(self, size: int, fold: Callable[[list[Any]], Any], lateness: int) -> None:
        super().__init__(fold, lateness)
        self.size = size
        self.buckets: dict[tuple[Any, int], list[Any]] = {}

    def _value(self, key: Any, t: int) -> Any:
        values = [
            v
            for (k, b), vs in sorted(self.buckets.items(), key=lambda i: i[0][1])
            if k == key and t - self.size < b <= t
            for v in vs
        ]
        return self.fold(values)

    def add(self, event: Event) -> None:
        key, ts, value = event
        if ts + self.lateness <= self.watermark:
            self.late.append(event)
            return
        self.buckets.setdefault((key, ts), []).append(value)
        if ts <= self.watermark:
            last = min(self.watermark, ts + self.size - 1)
            for k, t in sorted(self.buckets):
                if k == key and ts <= t <= last:
                    self.emitted[(key, t - self.size + 1, t + 1)].append(self._value(key, t))

    def advance(self, watermark: int) -> None:
        for key, t in sorted(self.buckets, key=lambda b: b[1]):
            if self.watermark < t <= watermark:
                self.emitted[(key, t - self.size + 1, t + 1)].append(self._value(key, t))
        keep = self.size - 1 + self.lateness
        for bucket in [b for b in self.buckets if b[1] + keep <= watermark]:
            del self.buckets[bucket]
        self.watermark = watermark
