"""State TTL on every state type and both backends: an entry expires ``ttl`` after its last
write (processing time), reads as absent at once, is deleted when read, is swept out
physically by ``delete_where(expired_entries(...))``, and keeps its expiry across a
checkpoint and restore."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from state_helpers import Keyed, take_checkpoint

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.descriptors import (
    AggregateFunction,
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    ValueState,
    expired_entries,
)


class Total(AggregateFunction[int, int, int]):
    def create_accumulator(self) -> int:
        return 0

    def add(self, value: int, accumulator: int) -> int:
        return accumulator + value

    def get_result(self, accumulator: int) -> int:
        return accumulator


TTL = timedelta(milliseconds=100)


def bind(backend: KeyedStateBackend) -> tuple[Keyed, dict[str, Any]]:
    keyed = Keyed(backend)
    return keyed, {
        "value": keyed.bind(ValueState("v", ttl=TTL), 1),
        "list": keyed.bind(ListState("l", ttl=TTL), 2),
        "map": keyed.bind(MapState("m", ttl=TTL), 3),
        "reducing": keyed.bind(ReducingState("r", reduce_fn=max, ttl=TTL), 4),
        "aggregating": keyed.bind(AggregatingState("a", aggregate=Total(), ttl=TTL), 5),
        "forever": keyed.bind(ValueState("f"), 6),
    }


def write_all(s: dict[str, Any]) -> None:
    s["value"].update(1)
    s["list"].add(2)
    s["map"].put("k", 3)
    s["reducing"].add(4)
    s["aggregating"].add(5)
    s["forever"].update(6)


def read_all(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "value": s["value"].value(),
        "list": s["list"].get(),
        "map": dict(s["map"].items()),
        "map_get": s["map"].get("k"),
        "reducing": s["reducing"].get(),
        "aggregating": s["aggregating"].get(),
        "forever": s["forever"].value(),
    }


LIVE = {
    "value": 1,
    "list": [2],
    "map": {"k": 3},
    "map_get": 3,
    "reducing": 4,
    "aggregating": 5,
    "forever": 6,
}
EXPIRED = {
    "value": None,
    "list": [],
    "map": {},
    "map_get": None,
    "reducing": None,
    "aggregating": None,
    "forever": 6,
}


def test_entries_expire_ttl_after_their_last_write(backend: KeyedStateBackend) -> None:
    keyed, s = bind(backend)
    keyed.at("alice").scope.now = 1_000
    write_all(s)
    keyed.scope.now = 1_099
    assert read_all(s) == LIVE
    keyed.scope.now = 1_100
    assert read_all(s) == EXPIRED
    s["value"].update(7)  # a write restarts the clock of that entry only
    keyed.scope.now = 1_199
    assert s["value"].value() == 7 and s["list"].get() == []


def test_expired_entries_are_removed_physically(
    make_backend: Callable[..., KeyedStateBackend],
) -> None:
    backend = make_backend()
    keyed, s = bind(backend)
    for i in range(20):
        keyed.at(f"k{i}").scope.now = 1_000 + i * 10
        write_all(s)
    # Entries written at 1000..1090 expire by 1150 (+100 ms); those at 1100.. do not.
    removed = backend.delete_where(expired_entries({1: 100, 2: 100, 3: 100, 4: 100, 5: 100}, 1_150))
    assert removed == 6 * 5  # five TTL states of keys k0..k5
    # Read "before" every expiry: only what the sweep deleted is gone.
    values = []
    for i in range(20):
        keyed.at(f"k{i}").scope.now = 0
        values.append(read_all(s)["value"])
    assert values == [None] * 6 + [1] * 14
    keyed.at("k0")
    assert s["forever"].value() == 6  # no TTL: never swept


def test_expiry_survives_checkpoint_and_restore(
    make_backend: Callable[..., KeyedStateBackend], storage: CheckpointStorage
) -> None:
    backend = make_backend()
    keyed, s = bind(backend)
    keyed.at("alice").scope.now = 5_000
    write_all(s)
    handle = take_checkpoint(backend, storage, 1)
    restored = make_backend()
    restored.restore(handle, storage)
    keyed2, s2 = bind(restored)
    keyed2.at("alice").scope.now = 5_099
    assert read_all(s2) == LIVE
    keyed2.scope.now = 5_100
    assert read_all(s2) == EXPIRED


def test_ttl_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="ttl"):
        ValueState("v", ttl=0)
    with pytest.raises(ConfigurationError, match="ttl"):
        MapState("m", ttl="1h")  # type: ignore[arg-type]
    assert ValueState("v", ttl=1.5).ttl_ms == 1_500
    assert ValueState("v", ttl=timedelta(minutes=1)).describe()["ttl_ms"] == 60_000
