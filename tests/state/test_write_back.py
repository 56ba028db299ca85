"""Value states under a write-back scope (the keyed process operator's): plain values wait in a
per-epoch cache and reach the backend at ``flush``; reads, snapshots and restores must be
indistinguishable from a state that writes through. Run on every backend (``conftest.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from state_helpers import Keyed, take_checkpoint

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import StateError
from snapline.pipeline.state import descriptors
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.descriptors import KeyScope, ValueState
from snapline.pipeline.state.serde import JsonSerde

Make = Callable[..., KeyedStateBackend]


def write_back(backend: KeyedStateBackend) -> Keyed:
    keyed = Keyed(backend)
    keyed.scope = KeyScope(write_back=True)
    return keyed


def stored(backend: KeyedStateBackend, keyed: Keyed, key: str, state_id: int = 1) -> Any:
    keyed.at(key)
    assert keyed.scope.prefix is not None
    return backend.get(keyed.scope.prefix + bytes([state_id]))


def test_plain_updates_reach_the_backend_at_flush(make_backend: Make) -> None:
    backend = make_backend()
    keyed = write_back(backend)
    total = keyed.bind(ValueState("total", default=0), 1)
    for _ in range(3):
        keyed.at("a")
        total.update(total.value() + 5)
    assert total.value() == 15
    assert stored(backend, keyed, "a") is None  # waiting in the cache
    keyed.scope.flush()
    assert stored(backend, keyed, "a") == b"15"
    keyed.at("a")
    assert total.value() == 15


def test_an_update_that_cannot_be_encoded_leaves_the_cached_value(make_backend: Make) -> None:
    backend = make_backend()
    keyed = write_back(backend)
    state = keyed.bind(ValueState("v"), 1)
    keyed.at("a")
    state.update(7)
    with pytest.raises(StateError, match="not JSON-serializable"):
        state.update({"ids": {1, 2}})  # a set: the update fails, as if never made
    assert state.value() == 7
    keyed.scope.flush()
    assert stored(backend, keyed, "a") == b"7"


def test_a_written_through_value_replaces_a_cached_one(make_backend: Make) -> None:
    backend = make_backend()
    keyed = write_back(backend)
    state = keyed.bind(ValueState("v"), 1)
    keyed.at("a")
    state.update(1)
    state.update({"n": 2})  # not plain: written at once, and the cached 1 is dropped
    assert state.value() == {"n": 2}
    keyed.scope.flush()
    assert state.value() == {"n": 2}
    state.update(3)
    state.update(None)  # a delete is written at once too
    keyed.scope.flush()
    assert state.value() is None and stored(backend, keyed, "a") is None
    state.update(4)
    state.clear()
    keyed.scope.flush()
    assert state.value() is None


def test_values_the_serde_would_change_are_written_through(make_backend: Make) -> None:
    backend = make_backend()
    keyed = write_back(backend)
    state = keyed.bind(ValueState("v"), 1)
    for key, value, reads_back in [
        ("big", 2**70, None),  # orjson refuses it: update raises, as without the cache
        ("nan", math.nan, None),  # JSON has no NaN: refused too (null read back as no value)
        ("tuple", (1, 2), [1, 2]),
        ("text", "größe", "größe"),
    ]:
        keyed.at(key)
        try:
            state.update(value)
        except Exception:
            assert reads_back is None and key in ("big", "nan")
            continue
        assert stored(backend, keyed, key) is not None, key  # no cache in between
        assert state.value() == reads_back, key


@pytest.mark.parametrize("cached", [True, False])
def test_a_flush_stores_what_the_serde_would(make_backend: Make, cached: bool) -> None:
    """Ints are written as their digits without the serde's call, at a flush and when written
    through: the bytes must be the serde's, bools (ints to Python) must stay JSON's true and
    false, and an int JSON cannot hold must still be refused."""
    backend = make_backend()
    keyed = write_back(backend) if cached else Keyed(backend)
    state = keyed.bind(ValueState("v"), 1)
    keyed.at("big")
    with pytest.raises(StateError, match="not JSON-serializable"):
        state.update(2**64)
    values = [0, 7, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**30, True, False, 1.5, 1e16, "x"]
    for i, value in enumerate(values):
        keyed.at(f"k{i}")
        state.update(value)
    keyed.scope.flush()
    for i, value in enumerate(values):
        keyed.at(f"k{i}")
        assert stored(backend, keyed, f"k{i}") == JsonSerde().dumps(value), value
        assert state.value() == value and type(state.value()) is type(value)


def test_other_serdes_and_ttl_never_wait(make_backend: Make) -> None:
    backend = make_backend()
    keyed = write_back(backend)
    text = keyed.bind(ValueState("s", serde="string"), 1)
    expiring = keyed.bind(ValueState("t", ttl=3600), 2)
    keyed.at("a")
    text.update(7)
    expiring.update(7)
    assert text.value() == "7"  # the string serde's round trip, not the cached int
    assert expiring.value() == 7
    assert stored(backend, keyed, "a", 1) == b"7"
    assert stored(backend, keyed, "a", 2) is not None


def test_a_large_key_space_pauses_the_cache_and_resumes_it(make_backend: Make) -> None:
    backend = make_backend()
    keyed = write_back(backend)
    state = keyed.bind(ValueState("v", default=0), 1)

    def epoch(keys: int, times: int) -> None:
        for _ in range(times):
            for k in range(keys):
                keyed.at(f"k{k}")
                state.update(state.value() + 1)
        keyed.scope.flush()

    epoch(100, 1)  # one update per key: the cache did not pay
    assert state._cache is None
    for _ in range(descriptors.WRITE_BACK_PAUSE):
        keyed.at("k1")
        state.update(state.value() + 1)
        assert stored(backend, keyed, "k1") is not None  # written through while paused
        keyed.scope.flush()
    assert state._cache == {}  # resumed
    epoch(10, 5)
    assert state._cache == {}  # five updates per key: it stays on
    keyed.at("k1")
    assert state.value() == 1 + descriptors.WRITE_BACK_PAUSE + 5


plain = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(max_codepoint=127), max_size=5),
    st.booleans(),
)
# Dicts of what JSON stores (orjson refuses ints beyond 64 bits): written through at once.
values = st.one_of(
    plain,
    st.none(),
    st.dictionaries(st.text(max_size=3), st.integers(-(2**63), 2**63 - 1), max_size=2),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.sampled_from("abc"), values),
        st.tuples(st.just("read"), st.sampled_from("abc"), st.none()),
        st.tuples(st.just("flush"), st.none(), st.none()),
        st.tuples(st.just("checkpoint"), st.none(), st.none()),
    ),
    max_size=40,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=operations)
def test_write_back_reads_and_restores_like_write_through(
    ops: list[tuple[str, Any, Any]], make_backend: Make, storage: CheckpointStorage
) -> None:
    """A model test: every read equals the last update; a checkpoint taken after the
    runtime's flush restores to exactly the values a write-through state holds."""
    backend = make_backend()
    keyed = write_back(backend)
    state = keyed.bind(ValueState("v"), 1)
    model: dict[str, Any] = {}
    checkpoints = 0
    for op, key, value in ops:
        if op == "update":
            keyed.at(key)
            state.update(value)
            if value is None:
                model.pop(key, None)
            else:
                model[key] = value
        elif op == "read":
            keyed.at(key)
            assert state.value() == model.get(key)
        elif op == "flush":
            keyed.scope.flush()
        else:
            checkpoints += 1
            keyed.scope.flush()  # what Task.snapshot_state does first
            handle = take_checkpoint(backend, storage, checkpoints)
            restored = make_backend()
            restored.restore(handle, storage)
            again = Keyed(restored)
            reader = again.bind(ValueState("v"), 1)
            for k in "abc":
                again.at(k)
                assert reader.value() == model.get(k)


@pytest.mark.parametrize(
    "value", [{"x": math.inf}, [1.0, math.nan], {"a": [{"b": -math.inf}]}, (math.nan,)]
)
def test_a_non_finite_float_inside_a_value_is_refused_too(value: Any) -> None:
    """orjson writes inf and NaN as null at any depth: {"x": inf} would read back as
    {"x": None}. Values with a plain None in them are stored as they are."""
    serde = JsonSerde()
    with pytest.raises(StateError, match="inf or NaN would read back as None"):
        serde.dumps(value)
    assert serde.loads(serde.dumps({"x": None, "y": [None, 1.5]})) == {"x": None, "y": [None, 1.5]}
