"""A bound state builds the stored key of the scope's prefix once and reuses it while the scope
stays on that prefix (a record's ``value()`` then ``update()``): it must never hand back the key
of another current key, nor another state's. Run on every backend (``conftest.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from state_helpers import Keyed

from snapline.pipeline.errors import StateError
from snapline.pipeline.state.backend import KeyedStateBackend
from snapline.pipeline.state.descriptors import KeyScope, ListState, MapState, ValueState

Make = Callable[..., KeyedStateBackend]


@pytest.mark.parametrize("write_back", [False, True])
def test_each_key_and_each_state_reads_and_writes_its_own_entry(
    make_backend: Make, write_back: bool
) -> None:
    backend = make_backend()
    keyed = Keyed(backend)
    keyed.scope = KeyScope(write_back=write_back)
    first = keyed.bind(ValueState("first", default=0), 1)
    second = keyed.bind(ValueState("second", default=0), 2)
    for key, amount in [("a", 1), ("b", 10), ("a", 2), ("bb", 100), ("b", 20)]:
        keyed.at(key)  # a new prefix object, equal to an earlier one for a key seen before
        first.update(first.value() + amount)
        second.update(second.value() + 2 * amount)
    keyed.scope.flush()
    expected = {"a": 3, "b": 30, "bb": 100}
    for key, total in expected.items():
        keyed.at(key)
        assert (first.value(), second.value()) == (total, 2 * total), key
        assert keyed.scope.prefix is not None
        assert backend.get(keyed.scope.prefix + b"\x01") == str(total).encode()
        assert backend.get(keyed.scope.prefix + b"\x02") == str(2 * total).encode()


def test_an_update_after_the_scope_moved_is_the_new_keys(make_backend: Make) -> None:
    """The reuse happens on the prefix object itself: the same bytes under a new current key
    still address that key's entry, and a key with no value reads the default."""
    backend = make_backend()
    keyed = Keyed(backend)
    total = keyed.bind(ValueState("total", default=0), 1)
    keyed.at("a")
    assert total.value() == 0
    keyed.at("b")
    total.update(5)  # no value() in between: the key built for "a" must not be used
    keyed.at("a")
    assert total.value() == 0
    keyed.at("b")
    assert total.value() == 5


def test_other_state_types_and_clear_follow_the_current_key(make_backend: Make) -> None:
    backend = make_backend()
    keyed = Keyed(backend)
    items = keyed.bind(ListState("items"), 1)
    seen = keyed.bind(MapState("seen"), 2)
    for key in ["a", "b", "a"]:
        keyed.at(key)
        items.add(key)
        seen.put(key, True)
    keyed.at("b")
    assert items.get() == ["b"] and list(seen.keys()) == ["b"]
    items.clear()
    keyed.at("a")
    assert items.get() == ["a", "a"] and list(seen.keys()) == ["a"]


def test_no_current_key_is_an_error_even_after_one(make_backend: Make) -> None:
    keyed = Keyed(make_backend())
    total = keyed.bind(ValueState("total", default=0), 1)
    keyed.at("a")
    total.update(1)
    keyed.scope.prefix = None  # the operator's batch ended
    with pytest.raises(StateError, match="no current key"):
        total.value()
    with pytest.raises(StateError, match="no current key"):
        total.update(2)
