"""The window operator: event-time windows on keyed state and timers (``snapline.windows``).

Per key, the open windows live in a map state ((start, end) -> accumulator; for sliding
windows, record timestamp -> values). A window registers an event-time timer at its last
millisecond (``end - 1``) to fire, and one at ``end - 1 + allowed_lateness`` to be purged;
timers are per (key, time), so one timer may serve several windows and a timer left behind
by a merged session finds nothing to do. A record is late when every window it belongs to is
past ``end - 1 + allowed_lateness`` at the task's watermark (or its key-group's floor after a
rescale: runtime/watermarks.py): it goes to the dead letters with
the reason, or with ``on_late="drop"`` is counted in ``late_dropped`` (the task sums it into
its own count, which metrics and the testing harness read) and logged: the first one with its
times, then at most one summary per ``LATE_LOG_INTERVAL`` seconds. A record that lands in a
window that already fired (within the allowed lateness) emits that window again at once,
with the updated value.

Everything a window emits is an output of the epoch in which its timer fired or its late
record arrived, and the timers' deletion is in the same epoch's state snapshot: exactly once.

Threads: the task thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from snapline.pipeline.keygroups import state_key_prefix
from snapline.pipeline.record import Record
from snapline.pipeline.runtime.operators import Operator, OperatorContext
from snapline.pipeline.runtime.timers import TimerService
from snapline.pipeline.runtime.watermarks import with_floors
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.descriptors import BoundMapState, KeyScope, MapState, StateDescriptor
from snapline.pipeline.state.timers import EVENT_TIME, TimerState
from snapline.pipeline.windows import (
    HoppingWindows,
    SessionWindows,
    SlidingWindows,
    TumblingWindows,
    WindowSpec,
)

log = logging.getLogger(__name__)

_MISSING = object()
#: Seconds between two log lines about late records dropped by one window operator: late
#: records can be many, the count is in the metrics.
LATE_LOG_INTERVAL = 60.0


class WindowOperator(Operator):
    """See module docstring."""

    def __init__(
        self,
        task: OperatorContext,
        name: str,
        spec: WindowSpec,
        states: list[tuple[int, StateDescriptor]],
        backend: KeyedStateBackend,
        max_parallelism: int,
        timers: TimerService | None = None,
    ) -> None:
        """``timers``: the timer service to use instead of one over the backend's timer state
        (the Spark streaming runner passes Spark's timers)."""
        super().__init__(task, name)
        self._spec = spec
        self._assigner = spec.assigner
        self._agg = spec.aggregation
        self._lateness = spec.allowed_lateness
        self._scope = KeyScope()
        self._windows: BoundMapState | None = None
        for state_id, desc in states:
            if isinstance(desc, TimerState):
                if timers is not None:
                    continue
                timers = TimerService(
                    desc.bind(backend, self._scope, state_id), self._scope, max_parallelism
                )
            elif isinstance(desc, MapState):
                self._windows = desc.bind(backend, self._scope, state_id)
                # The per-record path of fixed windows reads and writes the same map entries
                # through the backend directly (one key encoding per window, no wrappers).
                self._windows_sid = bytes([state_id])
                self._dump_window = desc.key_serde.dumps
                self._dump_acc = desc.serde.dumps
                self._load_acc = desc.serde.loads
        assert timers is not None and self._windows is not None
        self._backend = backend
        self._timers = timers
        #: Late records dropped (``on_late="drop"``) since the operator was built.
        self.late_dropped = 0
        self._late_logged = 0
        self._late_logged_at = 0.0
        self._out: list[Record] = []
        #: Encoded map keys of recent windows: every key of a window shares them.
        self._window_keys: dict[tuple[int, int], bytes] = {}
        if isinstance(self._assigner, SessionWindows):
            self._add = self._add_session
        elif isinstance(self._assigner, SlidingWindows):
            self._add = self._add_sliding
        else:
            self._add = self._add_fixed

    # ------------------------------------------------------------------ records
    def process(self, records: list[Record]) -> None:
        floors = getattr(self.task, "watermark_floors", None)
        if floors:  # after a rescale: some key-groups' event time is further (watermarks.py)
            for watermark, run in with_floors(self.watermark, floors, records):
                self._process(run, watermark)
        else:
            self._process(records, self.watermark)

    def _process(self, records: list[Record], watermark: int) -> None:
        scope = self._scope
        add = self._add
        for r in records:
            key_bytes = r.key_bytes
            assert key_bytes is not None
            scope.prefix = state_key_prefix(r.key_group, key_bytes)
            scope.key = r.key
            try:
                add(r, watermark)
            except Exception as exc:
                self.task.dead_letter(r, f"{self.name} raised {exc!r}")
        scope.prefix = None
        self._flush()

    def _late(self, r: Record, watermark: int, windows: Iterable[tuple[int, int]]) -> None:
        if self._spec.on_late == "drop":
            self.late_dropped += 1
            if self.late_dropped == 1:
                self._late_logged, self._late_logged_at = 1, time.monotonic()
                log.warning(
                    "%s (task %s): dropped a late record (on_late='drop'): event time %d, "
                    "watermark %d, allowed lateness %d ms; further drops are counted and "
                    "summarized at most every %.0f s",
                    self.name,
                    self.task.task_id,
                    r.timestamp,
                    watermark,
                    self._lateness,
                    LATE_LOG_INTERVAL,
                )
            return
        spans = ", ".join(f"[{s}, {e})" for s, e in windows)
        self.task.dead_letter(
            r,
            f"{self.name}: late record: event time {r.timestamp} arrived when the watermark was "
            f"{watermark}; its windows {spans} closed (allowed lateness "
            f"{self._lateness} ms)",
        )

    def _add_fixed(self, r: Record, watermark: int) -> None:
        assigner = self._assigner
        assert isinstance(assigner, TumblingWindows | HoppingWindows)
        windows = assigner.assign(r.timestamp)
        lateness = self._lateness
        accepted = [w for w in windows if w[1] - 1 + lateness > watermark]
        if not accepted:
            self._late(r, watermark, windows)
            return
        agg = self._agg
        backend = self._backend
        assert self._scope.prefix is not None
        prefix = self._scope.prefix + self._windows_sid
        keys = self._window_keys
        for span in accepted:
            window = keys.get(span)
            if window is None:
                if len(keys) > 4096:
                    keys.clear()
                window = keys[span] = self._dump_window(list(span))
            start, end = span
            raw = backend.map_get(prefix, window)
            new = raw is None
            acc = agg.add(agg.create() if raw is None else self._load_acc(raw), r.value)
            backend.map_put(prefix, window, self._dump_acc(acc))
            if end - 1 <= watermark:
                self._emit(r.key, r.key_bytes, r.key_group, start, end, acc)
            elif new:  # an existing on-time window registered its timer when it was created
                self._timers.register_event_time(end - 1)
            if lateness and new:
                self._timers.register_event_time(end - 1 + lateness)

    def _add_session(self, r: Record, watermark: int) -> None:
        assigner = self._assigner
        assert isinstance(assigner, SessionWindows)
        state = self._windows
        assert state is not None
        ts = r.timestamp
        start, end = ts, ts + assigner.gap
        merged: list[tuple[int, int, Any]] = []
        for (s, e), acc in state.items():
            if s <= end and start <= e:  # intersecting or touching sessions merge
                merged.append((s, e, acc))
        new_start = min([start, *(s for s, _, _ in merged)])
        new_end = max([end, *(e for _, e, _ in merged)])
        if new_end - 1 + self._lateness <= watermark:
            self._late(r, watermark, [(new_start, new_end)])
            return
        agg = self._agg
        parts = sorted([*merged, (start, end, agg.add(agg.create(), r.value))], key=_by_start)
        acc = parts[0][2]
        for _, _, other in parts[1:]:
            acc = agg.merge(acc, other)
        # Put first: a value the serde refuses (inf, NaN) is a dead letter with the sessions
        # it would have merged still there.
        state.put([new_start, new_end], acc)
        for s, e, _ in merged:
            if (s, e) != (new_start, new_end):
                state.remove([s, e])
        if new_end - 1 <= watermark:
            self._emit(r.key, r.key_bytes, r.key_group, new_start, new_end, acc)
        else:
            self._timers.register_event_time(new_end - 1)
        if self._lateness:
            self._timers.register_event_time(new_end - 1 + self._lateness)

    def _add_sliding(self, r: Record, watermark: int) -> None:
        assigner = self._assigner
        assert isinstance(assigner, SlidingWindows)
        buckets = self._windows
        assert buckets is not None
        ts = r.timestamp
        size = assigner.size
        if ts + self._lateness <= watermark:
            self._late(r, watermark, [(ts - size + 1, ts + 1)])
            return
        values = buckets.get(ts, _MISSING)
        buckets.put(ts, [r.value] if values is _MISSING else [*values, r.value])
        # The bucket is needed by the windows ending in [ts, ts + size - 1].
        self._timers.register_event_time(ts + size - 1 + self._lateness)
        if ts > watermark:
            self._timers.register_event_time(ts)
            return
        # Within the allowed lateness: every fired window that contains ts fires again.
        last = min(watermark, ts + size - 1)
        for t in sorted(t for t, _ in buckets.items() if ts <= t <= last):
            self._emit_sliding(r.key, r.key_bytes, r.key_group, t)

    # ------------------------------------------------------------------ timers
    def on_watermark(self, watermark: int) -> None:
        timers = self._timers
        timers.watermark = watermark
        scope = self._scope
        for ts, group, key_bytes, key in timers.due(EVENT_TIME, watermark):
            scope.prefix = state_key_prefix(group, key_bytes)
            scope.key = key
            if isinstance(self._assigner, SlidingWindows):
                self._on_sliding_timer(ts, key, key_bytes, group)
            else:
                self._on_window_timer(ts, key, key_bytes, group)
        scope.prefix = None
        self._flush()

    def _on_window_timer(self, ts: int, key: Any, key_bytes: bytes, group: int) -> None:
        state = self._windows
        assert state is not None
        lateness = self._lateness
        for (start, end), acc in sorted(state.items(), key=_by_window):
            if end - 1 == ts:
                self._emit(key, key_bytes, group, start, end, acc)
            if end - 1 + lateness <= ts:
                state.remove([start, end])
            elif end - 1 <= ts:
                # Fired and kept for late records: its purge timer. Registered when the
                # window was created, with the lateness of the code then; code restored with
                # a larger allowed_lateness kept such a window for good (timers are set
                # once, so this one is a no-op unless the lateness changed).
                self._timers.register_event_time(end - 1 + lateness)

    def _on_sliding_timer(self, ts: int, key: Any, key_bytes: bytes, group: int) -> None:
        buckets = self._windows
        assert buckets is not None
        assert isinstance(self._assigner, SlidingWindows)
        if buckets.contains(ts):
            self._emit_sliding(key, key_bytes, group, ts)
        size = self._assigner.size
        keep = size - 1 + self._lateness
        for t, _ in list(buckets.items()):
            if t + keep <= ts:
                buckets.remove(t)
            elif t + size - 1 <= ts:
                # Every window of the bucket fired; kept for late records until its purge
                # timer, set again in case the code's allowed_lateness grew since (as above).
                self._timers.register_event_time(t + keep)

    def _emit_sliding(self, key: Any, key_bytes: bytes | None, group: int, t: int) -> None:
        buckets = self._windows
        assert buckets is not None
        assert isinstance(self._assigner, SlidingWindows)
        size = self._assigner.size
        agg = self._agg
        try:
            acc = agg.create()
            for _, values in sorted((b, v) for b, v in buckets.items() if t - size < b <= t):
                for value in values:
                    acc = agg.add(acc, value)
        except Exception as exc:
            self._window_failed(key, key_bytes, group, t - size + 1, t + 1, exc)
            return
        self._emit(key, key_bytes, group, t - size + 1, t + 1, acc)

    # ------------------------------------------------------------------ output
    def _emit(
        self, key: Any, key_bytes: bytes | None, group: int, start: int, end: int, acc: Any
    ) -> None:
        try:
            result = self._agg.result(acc)
        except Exception as exc:
            self._window_failed(key, key_bytes, group, start, end, exc)
            return
        value = {"key": key, "start": start, "end": end, "value": result}
        self._out.append(Record(value, end - 1, "", -1, -1, key, key_bytes, group))

    def _window_failed(
        self,
        key: Any,
        key_bytes: bytes | None,
        group: int,
        start: int,
        end: int,
        exc: Exception,
    ) -> None:
        """User code raised while a window fired (its result, or a sliding window's folding):
        the window's dead letter, keyed by the key, instead of an error that would fail every
        retry of the epoch. The window is purged as if it had fired."""
        where = Record(None, end - 1, f"window:{self.name}", -1, -1, key, key_bytes, group)
        where.raw_key = key_bytes
        self.task.dead_letter(where, f"{self.name}: window [{start}, {end}) raised {exc!r}")

    def _flush(self) -> None:
        out, self._out = self._out, []
        self.emit(out)
        if self.late_dropped != self._late_logged:
            self._log_late_summary()

    def _log_late_summary(self) -> None:
        """At most once per LATE_LOG_INTERVAL: the drops since the last line (checked once per
        batch of records, not per record)."""
        now = time.monotonic()
        if now - self._late_logged_at < LATE_LOG_INTERVAL:
            return
        log.warning(
            "%s (task %s): late records dropped: %d more in the last %.0f s, %d in all "
            "(on_late='drop')",
            self.name,
            self.task.task_id,
            self.late_dropped - self._late_logged,
            now - self._late_logged_at,
            self.late_dropped,
        )
        self._late_logged, self._late_logged_at = self.late_dropped, now

    def on_barrier(self, barrier: Any) -> None:
        self.task.snapshot_state(barrier.checkpoint_id)


def _by_start(part: tuple[int, int, Any]) -> int:
    return part[0]


def _by_window(item: tuple[Any, Any]) -> tuple[int, int]:
    return (item[0][0], item[0][1])
