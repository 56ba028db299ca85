"""Timers as keyed state: how registered event- and processing-time timers are stored.

The timers of one operator are one state (``TimerState``, kind ``timers``) with its own state
id. Per key-group they form one map under the stored key of the empty key in that group
(``key_group | len 0 | state_id``); each entry is ``domain(1) | timestamp(8) | key bytes`` ->
the tagged key. So timers are key-group prefixed like every other state: checkpoints hold them
and a key-group range moves with its timers; and one key's timer is found without a scan.

Threads: the task thread, like every state.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from snapline.pipeline.keygroups import state_key_prefix
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.descriptors import KeyScope, StateDescriptor

EVENT_TIME = 0
PROCESSING_TIME = 1
#: Timestamps are signed milliseconds; stored biased so that byte order is time order.
_BIAS = 1 << 63
_TS = struct.Struct(">Q")


class TimerState(StateDescriptor):
    """The timers of one operator (declared by the runtime, never by users)."""

    kind = "timers"

    def __init__(self) -> None:
        super().__init__("__timers__", serde="json")

    def bind(self, backend: KeyedStateBackend, scope: KeyScope, state_id: int) -> TimerStore:
        return TimerStore(backend, state_id)


class TimerStore:
    """Add, remove and list the timers of one operator in a task's backend."""

    __slots__ = ("_backend", "_sid", "_prefixes")

    def __init__(self, backend: KeyedStateBackend, state_id: int) -> None:
        self._backend = backend
        self._sid = bytes([state_id])
        self._prefixes: dict[int, bytes] = {}

    def _prefix(self, key_group: int) -> bytes:
        prefix = self._prefixes.get(key_group)
        if prefix is None:
            prefix = self._prefixes[key_group] = state_key_prefix(key_group, b"") + self._sid
        return prefix

    @staticmethod
    def _entry(domain: int, timestamp: int, key_bytes: bytes) -> bytes:
        return bytes([domain]) + _TS.pack(timestamp + _BIAS) + key_bytes

    def contains(self, domain: int, timestamp: int, key_group: int, key_bytes: bytes) -> bool:
        entry = self._entry(domain, timestamp, key_bytes)
        return self._backend.map_get(self._prefix(key_group), entry) is not None

    def add(
        self, domain: int, timestamp: int, key_group: int, key_bytes: bytes, tagged_key: bytes
    ) -> bool:
        """Store the timer; False if it was already registered (a timer is registered once)."""
        prefix = self._prefix(key_group)
        entry = self._entry(domain, timestamp, key_bytes)
        if self._backend.map_get(prefix, entry) is not None:
            return False
        self._backend.map_put(prefix, entry, tagged_key)
        return True

    def remove(self, domain: int, timestamp: int, key_group: int, key_bytes: bytes) -> bool:
        """Delete the timer; False if it was not registered."""
        prefix = self._prefix(key_group)
        entry = self._entry(domain, timestamp, key_bytes)
        if self._backend.map_get(prefix, entry) is None:
            return False
        self._backend.map_delete(prefix, entry)
        return True

    def scan(self, max_parallelism: int) -> Iterator[tuple[int, int, int, bytes, bytes]]:
        """Every stored timer: (domain, timestamp, key-group, key bytes, tagged key)."""
        for group in range(max_parallelism):
            for entry, tagged in self._backend.map_items(self._prefix(group)):
                (biased,) = _TS.unpack_from(entry, 1)
                yield entry[0], biased - _BIAS, group, bytes(entry[9:]), tagged


def describe_timer(domain: int) -> str:
    return "event-time" if domain == EVENT_TIME else "processing-time"
