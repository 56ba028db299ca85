"""Keyed state types declared on a keyed process function, with Flink's semantics.

A descriptor (``ValueState("total", default=0)``) is a class attribute of a
``KeyedProcessFunction``. When a task starts, the runtime binds each descriptor to the
task's state backend; the bound object reads and writes the state of the *current key*
(the key of the record being processed). All five types work on any ``KeyedStateBackend``.

State TTL (``ttl=`` seconds or timedelta on any descriptor, processing time): every write
stamps the entry with its expiry (8 bytes before the serialized value; per entry for maps,
per list for lists); an expired entry reads as absent at once and is deleted when read, and
``expired_entries`` lets the runtime sweep the rest out before a snapshot.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any, Generic, TypeVar

from snapline.pipeline.errors import ConfigurationError, StateError
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.serde import JsonSerde, PickleSerde, Serde, resolve_serde

T = TypeVar("T")
ACC = TypeVar("ACC")
R = TypeVar("R")


class KeyScope:
    """The current key of a task: set by the keyed operator before each record.

    ``write_back`` (set by the operator before it binds states): value states keep the
    decoded values of plain scalars (see ``is_plain``) in a per-epoch cache and write them to the
    backend when the operator calls ``flush`` (at the barrier, before the snapshot), so a
    key updated many times in an epoch is decoded once and encoded once. Only for scopes whose
    ``prefix`` names one key (not Spark's per-key state handles, whose prefix is empty)."""

    __slots__ = ("prefix", "key", "now", "write_back", "flushers")

    def __init__(self, write_back: bool = False) -> None:
        self.prefix: bytes | None = None
        self.key: Any = None
        #: Processing time (ms) for state TTL, set per batch by the operator (None: the clock).
        self.now: int | None = None
        self.write_back = write_back
        #: The ``flush`` of every bound state that caches writes (see ``write_back``).
        self.flushers: list[Callable[[], None]] = []

    def flush(self) -> None:
        """Write every cached value to the backend and empty the caches."""
        for flush in self.flushers:
            flush()

    def now_ms(self) -> int:
        return self.now if self.now is not None else int(time.time() * 1000)

    def require(self, state_name: str) -> bytes:
        if self.prefix is None:
            raise StateError(
                f"state {state_name!r} was used with no current key; keyed state is only "
                "available inside process() of a function applied after key_by()"
            )
        return self.prefix


def _fresh(default: Any) -> Any:
    # A mutable default must not be shared between keys.
    return copy.deepcopy(default) if isinstance(default, list | dict | set) else default


def ttl_ms(ttl: float | timedelta | None, name: str | None) -> int | None:
    """A TTL (seconds or timedelta) in milliseconds; None for no TTL."""
    if ttl is None:
        return None
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds <= 0:
        raise ConfigurationError(
            f"state {name!r}: ttl={ttl!r} must be seconds > 0 or a timedelta (None: no TTL)"
        )
    return max(1, round(seconds * 1000))


_EXPIRY_BYTES = 8
#: No prefix yet (``_Bound._last_prefix``): never a scope's prefix, not even None.
_NO_PREFIX = object()
#: Serdes whose decode(encode(v)) is v for ``is_plain`` values (write-back caching is exact).
EXACT_SERDES = (JsonSerde, PickleSerde)


def _expiry(raw: bytes) -> int:
    return int.from_bytes(raw[:_EXPIRY_BYTES], "big")


class StateDescriptor(ABC):
    """Declares one keyed state; bound per task by the runtime. ``ttl`` (seconds or timedelta,
    processing time since the last write) makes entries expire."""

    kind = "abstract"

    def __init__(
        self,
        name: str | None = None,
        *,
        serde: Serde | str | None = None,
        ttl: float | timedelta | None = None,
    ) -> None:
        self.name = name
        self.serde = resolve_serde(serde)
        self.attribute: str | None = None
        self.ttl_ms = ttl_ms(ttl, name)

    def __set_name__(self, owner: type, attribute: str) -> None:
        self.attribute = attribute
        if self.name is None:
            self.name = attribute

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        raise StateError(
            f"state {self.name!r} of {type(instance).__name__} is not bound: keyed state works "
            "only while the function runs in a pipeline after key_by().process(...)"
        )

    @abstractmethod
    def bind(self, backend: KeyedStateBackend, scope: KeyScope, state_id: int) -> Any:
        """Return the live state object for one task."""

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "serde": self.serde.name,
        }
        if self.ttl_ms is not None:
            described["ttl_ms"] = self.ttl_ms
        return described


def expired_entries(ttls: dict[int, int], now_ms: int) -> Callable[[bytes, bytes], bool]:
    """A predicate over stored (key, value) pairs: True for an entry of a state with a TTL
    (``ttls``: state id -> TTL) whose expiry has passed. Stored keys (and map prefixes) start
    ``key_group(2) | len(4) | key | state_id``."""

    def expired(stored_key: bytes, value: bytes) -> bool:
        length = int.from_bytes(stored_key[2:6], "big")
        if len(stored_key) <= 6 + length or stored_key[6 + length] not in ttls:
            return False
        return _expiry(value) <= now_ms

    return expired


class _Bound:
    __slots__ = (
        "_backend",
        "_scope",
        "_sid",
        "_serde",
        "_name",
        "_get",
        "_put",
        "_loads",
        "_dumps",
        "_ttl",
        "_mget",
        "_mput",
        "_mitems",
        "_last_prefix",
        "_last_key",
    )

    def __init__(
        self, desc: StateDescriptor, backend: KeyedStateBackend, scope: KeyScope, state_id: int
    ) -> None:
        self._backend = backend
        self._scope = scope
        self._sid = bytes([state_id])
        #: The scope's prefix the last stored key was built from, and that key: a record's
        #: state calls (``value()`` then ``update()``) build and hash it once. Compared by
        #: identity: the reference keeps that prefix alive, so no other prefix can be it.
        self._last_prefix: object = _NO_PREFIX
        self._last_key = b""
        self._serde = desc.serde
        self._name = desc.name or "?"
        # Bound methods cached: state access is on the per-record hot path.
        self._get = backend.get
        self._put = backend.put
        self._loads = desc.serde.loads
        self._dumps = desc.serde.dumps
        self._ttl = desc.ttl_ms
        self._mget = backend.map_get
        self._mput = backend.map_put
        self._mitems = backend.map_items
        if self._ttl is not None:
            self._get, self._put = self._ttl_get, self._ttl_put
            self._mget, self._mput, self._mitems = self._ttl_mget, self._ttl_mput, self._ttl_mitems

    # TTL: values carry their expiry; an expired one is deleted when read.
    def _ttl_get(self, key: bytes) -> bytes | None:
        raw = self._backend.get(key)
        if raw is None:
            return None
        if _expiry(raw) <= self._scope.now_ms():
            self._backend.delete(key)
            return None
        return raw[_EXPIRY_BYTES:]

    def _stamp(self, value: bytes) -> bytes:
        assert self._ttl is not None
        return (self._scope.now_ms() + self._ttl).to_bytes(_EXPIRY_BYTES, "big") + value

    def _ttl_put(self, key: bytes, value: bytes) -> None:
        self._backend.put(key, self._stamp(value))

    def _ttl_mget(self, prefix: bytes, user_key: bytes) -> bytes | None:
        raw = self._backend.map_get(prefix, user_key)
        if raw is None:
            return None
        if _expiry(raw) <= self._scope.now_ms():
            self._backend.map_delete(prefix, user_key)
            return None
        return raw[_EXPIRY_BYTES:]

    def _ttl_mput(self, prefix: bytes, user_key: bytes, value: bytes) -> None:
        self._backend.map_put(prefix, user_key, self._stamp(value))

    def _ttl_mitems(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        now = self._scope.now_ms()
        live = []
        for user_key, raw in self._backend.map_items(prefix):
            if _expiry(raw) <= now:
                self._backend.map_delete(prefix, user_key)
            else:
                live.append((user_key, raw[_EXPIRY_BYTES:]))
        return iter(live)

    def _key(self) -> bytes:
        prefix = self._scope.prefix
        if prefix is self._last_prefix:
            return self._last_key
        if prefix is None:
            prefix = self._scope.require(self._name)
        key = self._last_key = prefix + self._sid
        self._last_prefix = prefix
        return key

    def clear(self) -> None:
        self._backend.delete(self._key())


# ---------------------------------------------------------------- ValueState
class ValueState(StateDescriptor, Generic[T]):
    """One value per key. ``value()`` returns the default until ``update`` is called."""

    kind = "value"

    def __init__(
        self,
        name: str | None = None,
        *,
        default: Any = None,
        serde: Serde | str | None = None,
        ttl: float | timedelta | None = None,
    ) -> None:
        super().__init__(name, serde=serde, ttl=ttl)
        self.default = default

    def bind(self, backend: KeyedStateBackend, scope: KeyScope, state_id: int) -> BoundValueState:
        return BoundValueState(self, backend, scope, state_id)


#: Largest number of values one state caches in an epoch before it writes them back early.
WRITE_BACK_ENTRIES = 200_000
#: Updates per cached key an epoch must average for the cache to stay on. Measured with a
#: value() + update() loop on the memory backend, 150,000 updates an epoch: 2 x faster than
#: writing through at 1,000 keys, even at 100,000 keys (1.9 updates per key), ~25 % slower
#: at 1,000,000 keys (1.1 per key), which pauses it.
WRITE_BACK_MIN_UPDATES = 1.5
#: Epochs a state writes through after an epoch below ``WRITE_BACK_MIN_UPDATES``.
WRITE_BACK_PAUSE = 8
WRITE_BACK_MAX_PAUSE = 64
_MISSING = object()
PLAIN_INT_MIN, PLAIN_INT_MAX = -(1 << 63), (1 << 64) - 1


def is_plain(value: Any) -> bool:
    """Whether ``value`` may wait in a write-back cache: immutable, and the JSON and pickle
    serdes encode it without error and decode it to an equal value of the same type (orjson
    refuses ints beyond 64 bits and strings with surrogates, and writes NaN as null)."""
    kind = type(value)
    if kind is int:
        return PLAIN_INT_MIN <= value <= PLAIN_INT_MAX
    if kind is float:
        return value - value == 0.0  # finite
    if kind is str:
        return value.isascii()
    return kind is bool


class BoundValueState(_Bound):
    """Under a ``write_back`` scope (the keyed process operator), an update to a plain value
    (``is_plain``) waits in a per-epoch cache, where reads find it; ``flush`` encodes and writes
    the cache to the backend. A key updated n times in an epoch is encoded once instead of n
    times and decoded at most once. Anything else (dicts, lists, other serdes, TTL) goes to
    the backend at once.

    The cache costs more than it saves when keys are updated about once an epoch (a large key
    space): after such an epoch the state writes through for ``WRITE_BACK_PAUSE`` epochs,
    then tries the cache again (each failed try doubles the pause, up to
    ``WRITE_BACK_MAX_PAUSE``)."""

    __slots__ = (
        "_default",
        "_mutable_default",
        "_cache",
        "_updates",
        "_paused",
        "_pause",
        "_int_digits",
    )

    def __init__(
        self, desc: ValueState[Any], backend: KeyedStateBackend, scope: KeyScope, state_id: int
    ) -> None:
        super().__init__(desc, backend, scope, state_id)
        self._default = desc.default
        self._mutable_default = isinstance(desc.default, list | dict | set)
        #: Updated plain values not yet written to the backend (stored key -> value); None
        #: when the state writes through (no write-back scope, or paused). Only a state that
        #: caches registers ``flush``, so ``flush`` sees None only while paused.
        self._cache: dict[bytes, Any] | None = None
        self._updates = 0
        #: Flushes left before the cache resumes; the next pause's length.
        self._paused = 0
        self._pause = WRITE_BACK_PAUSE
        #: The JSON serde: a plain int is written as its digits (see ``flush``), which is what
        #: the serde would write.
        self._int_digits = type(desc.serde) is JsonSerde
        if scope.write_back and desc.ttl_ms is None and type(desc.serde) in EXACT_SERDES:
            self._cache = {}
            scope.flushers.append(self.flush)

    # value() and update() run once per record: _key() is inlined.
    def value(self) -> Any:
        prefix = self._scope.prefix
        if prefix is self._last_prefix:
            key = self._last_key
        else:
            if prefix is None:
                prefix = self._scope.require(self._name)
            key = self._last_key = prefix + self._sid
            self._last_prefix = prefix
        cache = self._cache
        if cache:
            value = cache.get(key, _MISSING)
            if value is not _MISSING:
                return value
        raw = self._get(key)
        if raw is None:
            return _fresh(self._default) if self._mutable_default else self._default
        return self._loads(raw)

    def update(self, value: Any) -> None:
        prefix = self._scope.prefix
        if prefix is self._last_prefix:
            key = self._last_key
        else:
            if prefix is None:
                prefix = self._scope.require(self._name)
            key = self._last_key = prefix + self._sid
            self._last_prefix = prefix
        cache = self._cache
        # is_plain(value), its int case inlined (a counter's update, once per record)
        if cache is not None and (
            PLAIN_INT_MIN <= value <= PLAIN_INT_MAX
            if type(value) is int
            else value is not None and is_plain(value)
        ):
            cache[key] = value
            updates = self._updates = self._updates + 1
            # The cache holds at most one entry per update since the last flush: its len()
            # is looked at only once there were enough updates to exceed the limit.
            if updates > WRITE_BACK_ENTRIES and len(cache) > WRITE_BACK_ENTRIES:
                self.flush()
            return
        # Encoded before an older cached value is dropped: if encoding raises, that value stays.
        if value is None:
            encoded = None
        elif self._int_digits and type(value) is int and PLAIN_INT_MIN <= value <= PLAIN_INT_MAX:
            encoded = b"%d" % value  # the JSON serde's bytes, without its Python call
        else:
            encoded = self._dumps(value)
        if cache is not None:
            # Written through: the older cached value must neither be read nor written back.
            cache.pop(key, None)
        if encoded is None:
            self._backend.delete(key)
        else:
            self._put(key, encoded)

    def clear(self) -> None:
        self.update(None)

    def flush(self) -> None:
        """Encode and write the cached values to the backend; empty the cache. At the end of
        an epoch whose keys were updated fewer than ``WRITE_BACK_MIN_UPDATES`` times each on
        average, pause the cache; resume it after ``WRITE_BACK_PAUSE`` flushes."""
        cache = self._cache
        if cache is None:  # paused
            self._paused -= 1
            if self._paused <= 0:
                self._cache = {}
            return
        if cache:
            # put, not put_many: a backend's own write buffer and read cache stay coherent.
            put, dumps = self._put, self._dumps
            if self._int_digits:
                # An int's JSON is its decimal digits: b"%d" makes them without the serde's
                # Python call (and in an exact-size bytes object, as the serde does).
                for key, value in cache.items():
                    put(key, b"%d" % value if type(value) is int else dumps(value))
            else:
                for key, value in cache.items():
                    put(key, dumps(value))
            if self._updates < WRITE_BACK_MIN_UPDATES * len(cache):
                self._cache = None
                self._paused = self._pause
                self._pause = min(2 * self._pause, WRITE_BACK_MAX_PAUSE)
            else:
                self._pause = WRITE_BACK_PAUSE
            cache.clear()
        self._updates = 0


# ---------------------------------------------------------------- ListState
class ListState(StateDescriptor):
    """A list per key: ``add``, ``add_all``, ``update`` (replace), ``get`` (empty if none)."""

    kind = "list"

    def bind(self, backend: KeyedStateBackend, scope: KeyScope, state_id: int) -> BoundListState:
        return BoundListState(self, backend, scope, state_id)


class BoundListState(_Bound):
    __slots__ = ()

    def get(self) -> list[Any]:
        raw = self._get(self._key())
        return [] if raw is None else list(self._serde.loads(raw))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.get())

    def add(self, value: Any) -> None:
        items = self.get()
        items.append(value)
        self._put(self._key(), self._serde.dumps(items))

    def add_all(self, values: Iterable[Any]) -> None:
        items = self.get()
        items.extend(values)
        self._put(self._key(), self._serde.dumps(items))

    def update(self, values: Iterable[Any]) -> None:
        items = list(values)
        if items:
            self._put(self._key(), self._serde.dumps(items))
        else:
            self._backend.delete(self._key())


# ---------------------------------------------------------------- MapState
class MapState(StateDescriptor):
    """A map per key. User keys are serialized with ``key_serde`` (JSON by default)."""

    kind = "map"

    def __init__(
        self,
        name: str | None = None,
        *,
        serde: Serde | str | None = None,
        key_serde: Serde | str | None = None,
        ttl: float | timedelta | None = None,
    ) -> None:
        super().__init__(name, serde=serde, ttl=ttl)
        self.key_serde = resolve_serde(key_serde)

    def bind(self, backend: KeyedStateBackend, scope: KeyScope, state_id: int) -> BoundMapState:
        return BoundMapState(self, backend, scope, state_id)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "key_serde": self.key_serde.name}


class BoundMapState(_Bound):
    __slots__ = ("_kserde",)

    def __init__(
        self, desc: MapState, backend: KeyedStateBackend, scope: KeyScope, state_id: int
    ) -> None:
        super().__init__(desc, backend, scope, state_id)
        self._kserde = desc.key_serde

    def get(self, user_key: Any, default: Any = None) -> Any:
        raw = self._mget(self._key(), self._kserde.dumps(user_key))
        return default if raw is None else self._serde.loads(raw)

    def put(self, user_key: Any, value: Any) -> None:
        self._mput(self._key(), self._kserde.dumps(user_key), self._serde.dumps(value))

    def put_all(self, mapping: dict[Any, Any]) -> None:
        for k, v in mapping.items():
            self.put(k, v)

    def remove(self, user_key: Any) -> None:
        self._backend.map_delete(self._key(), self._kserde.dumps(user_key))

    def contains(self, user_key: Any) -> bool:
        return self._mget(self._key(), self._kserde.dumps(user_key)) is not None

    def items(self) -> Iterator[tuple[Any, Any]]:
        for k, v in self._mitems(self._key()):
            yield self._kserde.loads(k), self._serde.loads(v)

    def keys(self) -> Iterator[Any]:
        for k, _ in self.items():
            yield k

    def values(self) -> Iterator[Any]:
        for _, v in self.items():
            yield v

    def is_empty(self) -> bool:
        return next(iter(self._mitems(self._key())), None) is None

    def clear(self) -> None:
        self._backend.map_clear(self._key())


# ---------------------------------------------------------------- ReducingState
class ReducingState(StateDescriptor):
    """Keeps one value per key, combined on ``add`` by ``reduce_fn(current, new)``."""

    kind = "reducing"

    def __init__(
        self,
        name: str | None = None,
        *,
        reduce_fn: Callable[[Any, Any], Any],
        serde: Serde | str | None = None,
        ttl: float | timedelta | None = None,
    ) -> None:
        super().__init__(name, serde=serde, ttl=ttl)
        if not callable(reduce_fn):
            raise StateError(f"ReducingState {name!r} needs a callable reduce_fn")
        self.reduce_fn = reduce_fn

    def bind(
        self, backend: KeyedStateBackend, scope: KeyScope, state_id: int
    ) -> BoundReducingState:
        return BoundReducingState(self, backend, scope, state_id)


class BoundReducingState(_Bound):
    __slots__ = ("_reduce",)

    def __init__(
        self, desc: ReducingState, backend: KeyedStateBackend, scope: KeyScope, state_id: int
    ) -> None:
        super().__init__(desc, backend, scope, state_id)
        self._reduce = desc.reduce_fn

    def get(self) -> Any:
        raw = self._get(self._key())
        return None if raw is None else self._serde.loads(raw)

    def add(self, value: Any) -> None:
        key = self._key()
        raw = self._get(key)
        merged = value if raw is None else self._reduce(self._serde.loads(raw), value)
        self._put(key, self._serde.dumps(merged))


# ---------------------------------------------------------------- AggregatingState
class AggregateFunction(ABC, Generic[T, ACC, R]):
    """Flink's AggregateFunction: an accumulator built from inputs, then a result."""

    @abstractmethod
    def create_accumulator(self) -> ACC: ...

    @abstractmethod
    def add(self, value: T, accumulator: ACC) -> ACC: ...

    @abstractmethod
    def get_result(self, accumulator: ACC) -> R: ...

    def merge(self, a: ACC, b: ACC) -> ACC:
        raise NotImplementedError(f"{type(self).__name__} does not implement merge()")


class AggregatingState(StateDescriptor):
    """Aggregates inputs into an accumulator per key; ``get`` returns ``get_result(acc)``."""

    kind = "aggregating"

    def __init__(
        self,
        name: str | None = None,
        *,
        aggregate: AggregateFunction[Any, Any, Any],
        serde: Serde | str | None = None,
        ttl: float | timedelta | None = None,
    ) -> None:
        super().__init__(name, serde=serde, ttl=ttl)
        if not isinstance(aggregate, AggregateFunction):
            raise StateError(f"AggregatingState {name!r} needs an AggregateFunction instance")
        self.aggregate = aggregate

    def bind(
        self, backend: KeyedStateBackend, scope: KeyScope, state_id: int
    ) -> BoundAggregatingState:
        return BoundAggregatingState(self, backend, scope, state_id)


class BoundAggregatingState(_Bound):
    __slots__ = ("_agg",)

    def __init__(
        self, desc: AggregatingState, backend: KeyedStateBackend, scope: KeyScope, state_id: int
    ) -> None:
        super().__init__(desc, backend, scope, state_id)
        self._agg = desc.aggregate

    def get(self) -> Any:
        raw = self._get(self._key())
        return None if raw is None else self._agg.get_result(self._serde.loads(raw))

    def add(self, value: Any) -> None:
        key = self._key()
        raw = self._get(key)
        acc = self._agg.create_accumulator() if raw is None else self._serde.loads(raw)
        self._put(key, self._serde.dumps(self._agg.add(value, acc)))


def declared_states(function_type: type) -> list[StateDescriptor]:
    """The state descriptors declared on a class (and its bases), in a stable order."""
    found: dict[str, StateDescriptor] = {}
    for klass in reversed(function_type.__mro__):
        for attr, value in vars(klass).items():
            if isinstance(value, StateDescriptor):
                found[attr] = value
    return [found[a] for a in sorted(found)]
