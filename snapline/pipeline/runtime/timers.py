"""The timer service of one keyed operator in one task: what ``ctx.timers`` is.

Timers live in the task's keyed state (``snapline.pipeline.state.timers``), so a checkpoint
holds exactly the timers registered and not yet fired when its barrier passed; two in-memory
heaps (event time, processing time) order them for firing and are rebuilt from the state
when the task starts. A timer fires once per registration: it is deleted from the state
before its callback runs, in the same epoch as the callback's outputs.

Threads: the task thread.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterator

from snapline.pipeline.formats import tag_key, untag_key
from snapline.pipeline.keygroups import state_key_prefix
from snapline.pipeline.runtime.watermarks import MAX_WATERMARK, MIN_WATERMARK
from snapline.pipeline.state.descriptors import KeyScope
from snapline.pipeline.state.timers import EVENT_TIME, PROCESSING_TIME, TimerStore

log = logging.getLogger(__name__)

_Entry = tuple[int, int, bytes, bytes]  # timestamp, key-group, key bytes, tagged key


def processing_time_ms() -> int:
    return int(time.time() * 1000)


#: Deleted timers' heap entries tolerated before a compaction is considered.
COMPACT_AT = 1024
#: At the end of a bounded input (the watermark at its maximum) every timer fires, and the
#: timers those firings register fire in the next round, for at most this many rounds: a
#: timer that registers the next one (every second, say) would otherwise fire forever.
END_ROUNDS = 100


class TimerService:
    """Register and delete timers of the current key (the key of the record or timer being
    processed). Timestamps are int milliseconds: event time for ``*_event_time``, wall-clock
    time since the epoch for ``*_processing_time``."""

    def __init__(
        self,
        store: TimerStore,
        scope: KeyScope,
        max_parallelism: int,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self._store = store
        self._clock = clock or processing_time_ms
        self._scope = scope
        self._heaps: tuple[list[_Entry], list[_Entry]] = ([], [])
        #: Heap entries of deleted timers, per domain, not yet popped (see ``_compact``).
        self._stale = [0, 0]
        self.watermark = MIN_WATERMARK
        for domain, ts, group, key_bytes, tagged in store.scan(max_parallelism):
            self._heaps[domain].append((ts, group, key_bytes, tagged))
        for heap in self._heaps:
            heapq.heapify(heap)

    # ------------------------------------------------------------------ user API
    def current_watermark(self) -> int:
        return self.watermark

    def current_processing_time(self) -> int:
        return self._clock()

    def register_event_time(self, timestamp: int) -> None:
        """Call ``on_timer(timestamp, ctx)`` for the current key once the watermark reaches
        ``timestamp`` (at the next watermark advance if it already has)."""
        self._register(EVENT_TIME, timestamp)

    def delete_event_time(self, timestamp: int) -> None:
        self._delete(EVENT_TIME, timestamp)

    def register_processing_time(self, timestamp: int) -> None:
        """Call ``on_timer(timestamp, ctx)`` for the current key once the wall clock reaches
        ``timestamp`` (ms since the epoch)."""
        self._register(PROCESSING_TIME, timestamp)

    def delete_processing_time(self, timestamp: int) -> None:
        self._delete(PROCESSING_TIME, timestamp)

    # ------------------------------------------------------------------ runtime
    def _current(self) -> tuple[int, bytes, bytes]:
        prefix = self._scope.require("timers")
        group = int.from_bytes(prefix[:2], "big")
        key_bytes = prefix[6:]
        return group, key_bytes, prefix

    def _register(self, domain: int, timestamp: int) -> None:
        if not isinstance(timestamp, int) or isinstance(timestamp, bool):
            raise TypeError(f"timer timestamp {timestamp!r} must be int milliseconds")
        group, key_bytes, _ = self._current()
        tagged = tag_key(self._scope.key, key_bytes)
        if self._store.add(domain, timestamp, group, key_bytes, tagged):
            heapq.heappush(self._heaps[domain], (timestamp, group, key_bytes, tagged))

    def _delete(self, domain: int, timestamp: int) -> None:
        group, key_bytes, _ = self._current()
        # The heap entry stays; ``due`` skips entries no longer in the state, and the heap is
        # compacted once such entries are most of it.
        if self._store.remove(domain, timestamp, group, key_bytes):
            self._stale[domain] += 1
            heap = self._heaps[domain]
            if self._stale[domain] > COMPACT_AT and 2 * self._stale[domain] > len(heap):
                self._compact(domain)

    def _compact(self, domain: int) -> None:
        """Drop the heap entries of deleted timers. "Delete the old timeout, register a new
        one" per record left one entry per record until its time passed: at 100,000 records/s
        and a 30-minute timeout, 180 million entries. Amortized O(1) per deletion."""
        store = self._store
        kept = {
            entry
            for entry in self._heaps[domain]
            if store.contains(domain, entry[0], entry[1], entry[2])
        }
        heap = list(kept)
        heapq.heapify(heap)
        self._heaps[domain][:] = heap
        self._stale[domain] = 0

    def next_processing_time(self) -> int | None:
        heap = self._heaps[PROCESSING_TIME]
        return heap[0][0] if heap else None

    def due(self, domain: int, limit: int) -> Iterator[tuple[int, int, bytes, object]]:
        """Timers of ``domain`` at or before ``limit``, in time order, each removed from the
        state as it is yielded: (timestamp, key-group, key bytes, key). Timers registered
        meanwhile at or before ``limit`` are yielded too."""
        if limit >= MAX_WATERMARK:
            yield from self._due_at_end(domain)
            return
        heap = self._heaps[domain]
        store = self._store
        while heap and heap[0][0] <= limit:
            ts, group, key_bytes, tagged = heapq.heappop(heap)
            if store.remove(domain, ts, group, key_bytes):
                yield ts, group, key_bytes, untag_key(tagged)[0]
            elif self._stale[domain]:
                self._stale[domain] -= 1

    def _due_at_end(self, domain: int) -> Iterator[tuple[int, int, bytes, object]]:
        """Every timer, in rounds: the timers there are, in time order; then the ones they
        registered; at most END_ROUNDS rounds (then the rest is logged, not fired)."""
        heap, store = self._heaps[domain], self._store
        for _ in range(END_ROUNDS):
            if not heap:
                return
            batch = sorted(heap)
            heap.clear()  # what the firings register goes into the next round
            self._stale[domain] = 0
            for ts, group, key_bytes, tagged in batch:
                if store.remove(domain, ts, group, key_bytes):
                    yield ts, group, key_bytes, untag_key(tagged)[0]
        if heap:
            log.warning(
                "end of input: timers still registering new timers after %d rounds; %d not "
                "fired (an on_timer that always registers the next timer never ends: check "
                "ctx.watermark == 2**63 - 1 there)",
                END_ROUNDS,
                len(heap),
            )

    @staticmethod
    def prefix_of(group: int, key_bytes: bytes) -> bytes:
        return state_key_prefix(group, key_bytes)
