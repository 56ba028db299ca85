"""The shared state suite: the five state types, snapshots and restores, run on every backend.

Every test here is parametrized over ``memory`` and ``rocksdb`` (see ``conftest.py``): the
backends must be indistinguishable through the state API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from state_helpers import Keyed, checkpoint_directory, take_checkpoint

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, CorruptCheckpointError, StateError
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.descriptors import (
    AggregateFunction,
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    ValueState,
)


class Average(AggregateFunction[float, list[float], float]):
    def create_accumulator(self) -> list[float]:
        return [0.0, 0]

    def add(self, value: float, accumulator: list[float]) -> list[float]:
        return [accumulator[0] + value, accumulator[1] + 1]

    def get_result(self, accumulator: list[float]) -> float:
        return accumulator[0] / accumulator[1]


def bind_all(backend: KeyedStateBackend) -> tuple[Keyed, dict[str, Any]]:
    keyed = Keyed(backend)
    states = {
        "value": keyed.bind(ValueState("count", default=0), 0),
        "list": keyed.bind(ListState("events"), 1),
        "map": keyed.bind(MapState("seen"), 2),
        "reducing": keyed.bind(ReducingState("max", reduce_fn=max), 3),
        "aggregating": keyed.bind(AggregatingState("avg", aggregate=Average()), 4),
        "mutable": keyed.bind(ValueState("bag", default=[]), 5),
    }
    return keyed, states


# ------------------------------------------------------------------ semantics of the five types
def test_value_state_default_update_clear(backend: KeyedStateBackend) -> None:
    keyed, s = bind_all(backend)
    keyed.at("alice")
    assert s["value"].value() == 0
    s["value"].update(5)
    assert s["value"].value() == 5
    s["value"].update({"nested": [1, 2]})
    assert s["value"].value() == {"nested": [1, 2]}
    s["value"].clear()
    assert s["value"].value() == 0
    s["value"].update(3)
    s["value"].update(None)  # None deletes, like Flink's update(null)
    assert s["value"].value() == 0


def test_mutable_default_is_not_shared(backend: KeyedStateBackend) -> None:
    keyed, s = bind_all(backend)
    keyed.at("a")
    bag = s["mutable"].value()
    bag.append("x")
    assert s["mutable"].value() == []
    keyed.at("b")
    assert s["mutable"].value() == []


def test_list_state(backend: KeyedStateBackend) -> None:
    keyed, s = bind_all(backend)
    keyed.at("k")
    events = s["list"]
    assert events.get() == []
    events.add(1)
    events.add_all([2, 3])
    assert events.get() == [1, 2, 3]
    assert list(events) == [1, 2, 3]
    events.update(["a"])
    assert events.get() == ["a"]
    events.update([])
    assert events.get() == []
    events.add("again")
    events.clear()
    assert events.get() == []


def test_map_state(backend: KeyedStateBackend) -> None:
    keyed, s = bind_all(backend)
    keyed.at("k")
    seen = s["map"]
    assert seen.is_empty()
    assert seen.get("missing") is None
    assert seen.get("missing", 7) == 7
    seen.put("a", 1)
    seen.put_all({"b": 2, "c": [3]})
    seen.put(42, "int key")
    assert seen.get("a") == 1
    assert seen.contains("b")
    assert not seen.contains("z")
    assert dict(seen.items()) == {"a": 1, "b": 2, "c": [3], 42: "int key"}
    assert sorted(map(str, seen.keys())) == ["42", "a", "b", "c"]
    assert sorted(map(str, seen.values())) == sorted(["1", "2", "[3]", "int key"])
    seen.put("a", 10)
    assert seen.get("a") == 10
    seen.remove("a")
    seen.remove("never there")
    assert not seen.contains("a")
    assert not seen.is_empty()
    seen.clear()
    assert seen.is_empty()
    assert list(seen.items()) == []


def test_map_state_mutation_while_iterating(backend: KeyedStateBackend) -> None:
    keyed, s = bind_all(backend)
    keyed.at("k")
    for i in range(20):
        s["map"].put(f"u{i}", i)
    for user_key, value in s["map"].items():
        if value % 2:
            s["map"].remove(user_key)
    assert sorted(v for _, v in s["map"].items()) == list(range(0, 20, 2))


def test_reducing_state(backend: KeyedStateBackend) -> None:
    keyed, s = bind_all(backend)
    keyed.at("k")
    assert s["reducing"].get() is None
    for value in (3, 9, 4):
        s["reducing"].add(value)
    assert s["reducing"].get() == 9
    s["reducing"].clear()
    assert s["reducing"].get() is None


def test_aggregating_state(backend: KeyedStateBackend) -> None:
    keyed, s = bind_all(backend)
    keyed.at("k")
    assert s["aggregating"].get() is None
    for value in (1.0, 2.0, 6.0):
        s["aggregating"].add(value)
    assert s["aggregating"].get() == pytest.approx(3.0)
    s["aggregating"].clear()
    assert s["aggregating"].get() is None


def test_keys_are_independent(backend: KeyedStateBackend) -> None:
    keyed, s = bind_all(backend)
    # "a" and "a\x01..." would collide without the length field in the stored prefix.
    keys = ["a", "ab", "a\x01", "b", "", "ключ"]
    for i, key in enumerate(keys):
        keyed.at(key)
        s["value"].update(i + 1)
        s["list"].add(key)
        s["map"].put("who", key)
        s["map"].put(f"only-{i}", i)
        s["reducing"].add(i)
        s["aggregating"].add(float(i))
    for i, key in enumerate(keys):
        keyed.at(key)
        assert s["value"].value() == i + 1
        assert s["list"].get() == [key]
        assert dict(s["map"].items()) == {"who": key, f"only-{i}": i}
        assert s["reducing"].get() == i
        assert s["aggregating"].get() == pytest.approx(float(i))
    keyed.at("a")
    s["map"].clear()
    s["value"].clear()
    keyed.at("ab")
    assert dict(s["map"].items()) == {"who": "ab", "only-1": 1}
    assert s["value"].value() == 2


def test_state_ids_are_independent(backend: KeyedStateBackend) -> None:
    keyed = Keyed(backend)
    first = keyed.bind(ValueState("first"), 0)
    second = keyed.bind(ValueState("second"), 1)
    map_a = keyed.bind(MapState("a"), 2)
    map_b = keyed.bind(MapState("b"), 3)
    keyed.at("k")
    first.update("one")
    second.update("two")
    map_a.put("x", 1)
    map_b.put("x", 2)
    assert (first.value(), second.value()) == ("one", "two")
    assert (map_a.get("x"), map_b.get("x")) == (1, 2)
    map_a.clear()
    first.clear()
    assert second.value() == "two"
    assert map_b.get("x") == 2
    assert map_a.is_empty()


def test_state_without_current_key_fails(backend: KeyedStateBackend) -> None:
    keyed, s = bind_all(backend)
    with pytest.raises(StateError, match="no current key"):
        s["value"].value()


def test_raw_interface_separates_values_and_maps(backend: KeyedStateBackend) -> None:
    prefix = b"\x00\x07\x00\x00\x00\x01k\x02"
    backend.put(prefix, b"plain")
    backend.map_put(prefix, b"", b"empty user key")
    backend.map_put(prefix, b"u", b"entry")
    assert backend.get(prefix) == b"plain"
    assert sorted(backend.map_items(prefix)) == [(b"", b"empty user key"), (b"u", b"entry")]
    backend.delete(prefix)
    assert backend.map_get(prefix, b"u") == b"entry"
    backend.map_clear(prefix)
    assert backend.map_get(prefix, b"") is None
    assert list(backend.map_items(prefix)) == []


# ------------------------------------------------------------------ snapshots and restores
def fill(keyed: Keyed, s: dict[str, Any], keys: int, tag: str = "") -> None:
    for i in range(keys):
        keyed.at(f"key-{i}")
        s["value"].update(i)
        s["list"].add_all([i, tag])
        s["map"].put(f"m{i % 3}", tag)
        s["reducing"].add(i)
        s["aggregating"].add(float(i))


def check(keyed: Keyed, s: dict[str, Any], keys: int, tag: str = "") -> None:
    for i in range(keys):
        keyed.at(f"key-{i}")
        assert s["value"].value() == i
        assert s["list"].get() == [i, tag]
        assert dict(s["map"].items()) == {f"m{i % 3}": tag}
        assert s["reducing"].get() == i
        assert s["aggregating"].get() == pytest.approx(float(i))


def test_snapshot_restore_round_trip(
    make_backend: Callable[..., KeyedStateBackend], storage: CheckpointStorage
) -> None:
    source = make_backend()
    keyed, s = bind_all(source)
    fill(keyed, s, 300, "v1")
    handle = take_checkpoint(source, storage, 1)
    assert handle.backend == source.name
    assert all(storage.exists(f.path) for f in handle.files)

    target = make_backend()
    keyed2, s2 = bind_all(target)
    keyed2.at("stale")
    s2["value"].update("must vanish")
    target.restore(handle, storage)
    check(keyed2, s2, 300, "v1")
    keyed2.at("stale")
    assert s2["value"].value() == 0
    # The restored backend keeps working and checkpoints again.
    fill(keyed2, s2, 10, "v2")
    third = make_backend()
    third.restore(take_checkpoint(target, storage, 2), storage)
    keyed3, s3 = bind_all(third)
    keyed3.at("key-5")
    assert s3["list"].get() == [5, "v1", 5, "v2"]
    keyed3.at("key-200")
    assert s3["list"].get() == [200, "v1"]


def test_snapshot_is_isolated_from_later_writes(
    make_backend: Callable[..., KeyedStateBackend], storage: CheckpointStorage
) -> None:
    source = make_backend()
    keyed, s = bind_all(source)
    fill(keyed, s, 50, "before")
    snapshot = source.snapshot(1)
    # The task keeps processing while the checkpoint thread materializes.
    fill(keyed, s, 80, "after")
    keyed.at("key-1")
    s["map"].clear()
    handle = snapshot.materialize(storage, checkpoint_directory("t0", 1))
    snapshot.release()

    target = make_backend()
    target.restore(handle, storage)
    keyed2, s2 = bind_all(target)
    check(keyed2, s2, 50, "before")
    keyed2.at("key-60")
    assert s2["value"].value() == 0


def test_empty_state_round_trip(
    make_backend: Callable[..., KeyedStateBackend], storage: CheckpointStorage
) -> None:
    handle = take_checkpoint(make_backend(), storage, 1)
    target = make_backend()
    target.restore(handle, storage)
    keyed, s = bind_all(target)
    keyed.at("x")
    assert s["value"].value() == 0


def _flip_middle_byte(storage: CheckpointStorage, path: str) -> None:
    data = bytearray(storage.read_bytes(path))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(path, bytes(data))


def test_corrupt_state_file_is_detected(
    make_backend: Callable[..., KeyedStateBackend], storage: CheckpointStorage
) -> None:
    source = make_backend()
    keyed, s = bind_all(source)
    fill(keyed, s, 200)
    handle = take_checkpoint(source, storage, 1)
    biggest = max(handle.files, key=lambda f: f.size)
    _flip_middle_byte(storage, biggest.path)
    with pytest.raises(CorruptCheckpointError, match=biggest.path.rsplit("/", 1)[-1]):
        make_backend().restore(handle, storage)


def test_missing_state_file_is_detected(
    make_backend: Callable[..., KeyedStateBackend], storage: CheckpointStorage
) -> None:
    source = make_backend()
    keyed, s = bind_all(source)
    fill(keyed, s, 20)
    handle = take_checkpoint(source, storage, 1)
    victim = max(handle.files, key=lambda f: f.size)
    storage.delete_file(victim.path)
    with pytest.raises(CheckpointError, match=victim.path.rsplit("/", 1)[-1]):
        make_backend().restore(handle, storage)


def test_failed_restore_leaves_backend_usable(
    make_backend: Callable[..., KeyedStateBackend], storage: CheckpointStorage
) -> None:
    source = make_backend()
    keyed, s = bind_all(source)
    fill(keyed, s, 20)
    good = take_checkpoint(source, storage, 1)
    fill(keyed, s, 20, "newer")
    bad = take_checkpoint(source, storage, 2)
    for f in bad.files:
        if f.path not in {g.path for g in good.files} and f.size > 100:
            _flip_middle_byte(storage, f.path)
    target = make_backend()
    with pytest.raises(CorruptCheckpointError):
        target.restore(bad, storage)
    target.restore(good, storage)  # what the runtime's opt-in rewind does
    keyed2, s2 = bind_all(target)
    check(keyed2, s2, 20)


# ------------------------------------------------------------------ model-based comparison
_keys = st.sampled_from(
    [b"\x00\x01\x00\x00\x00\x01a", b"\x00\x01\x00\x00\x00\x02ab", b"\x00\x02\x00\x00\x00\x01b"]
)
_sids = st.sampled_from([b"\x00", b"\x01"])
_bytes = st.binary(max_size=12)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), _keys, _sids, _bytes),
        st.tuples(st.just("delete"), _keys, _sids),
        st.tuples(st.just("map_put"), _keys, _sids, _bytes, _bytes),
        st.tuples(st.just("map_delete"), _keys, _sids, _bytes),
        st.tuples(st.just("map_clear"), _keys, _sids),
        st.tuples(st.just("checkpoint_restore")),
    ),
    max_size=40,
)


def _apply(backend: KeyedStateBackend, op: tuple[Any, ...]) -> None:
    name, *args = op
    if name == "put":
        backend.put(args[0] + args[1], args[2])
    elif name == "delete":
        backend.delete(args[0] + args[1])
    elif name == "map_put":
        backend.map_put(args[0] + args[1], args[2], args[3])
    elif name == "map_delete":
        backend.map_delete(args[0] + args[1], args[2])
    elif name == "map_clear":
        backend.map_clear(args[0] + args[1])


def _observe(backend: KeyedStateBackend) -> dict[bytes, Any]:
    seen: dict[bytes, Any] = {}
    for key in (
        b"\x00\x01\x00\x00\x00\x01a",
        b"\x00\x01\x00\x00\x00\x02ab",
        b"\x00\x02\x00\x00\x00\x01b",
    ):
        for sid in (b"\x00", b"\x01"):
            seen[key + sid] = (backend.get(key + sid), sorted(backend.map_items(key + sid)))
    return seen


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_ops)
def test_backends_agree_on_random_operations(
    ops: list[tuple[Any, ...]], tmp_path_factory: Any
) -> None:
    from snapline.pipeline.state import create_backend

    root = tmp_path_factory.mktemp("model")
    storage = CheckpointStorage(str(root / "storage"))
    backends = [create_backend("memory"), create_backend("rocksdb", task_dir=str(root / "r0"))]
    try:
        checkpoint_id = 0
        for op in ops:
            if op[0] == "checkpoint_restore":
                checkpoint_id += 1
                restored = []
                for i, b in enumerate(backends):
                    handle = take_checkpoint(b, storage, checkpoint_id, task=f"t{i}")
                    fresh = create_backend(b.name, task_dir=str(root / f"r{checkpoint_id}"))
                    fresh.restore(handle, storage)
                    b.close()
                    restored.append(fresh)
                backends = restored
            else:
                for b in backends:
                    _apply(b, op)
            assert _observe(backends[0]) == _observe(backends[1])
    finally:
        for b in backends:
            b.close()
