"""Whole-column work on stored keys: split and build are inverses; backends export and bulk
load the same entries as ``items`` and ``put``/``map_put``; memory snapshots of the earlier
per-entry format still restore."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pyarrow as pa
import pytest

from snapline.pipeline.checkpoint.storage import CheckpointStorage, crc32_checksum
from snapline.pipeline.errors import StateError
from snapline.pipeline.keygroups import state_key_prefix
from snapline.pipeline.state.backend import KeyedStateBackend, StateFile, StateHandle
from snapline.pipeline.state.columns import build_stored_keys, split_stored_keys
from snapline.pipeline.state.memory import MemoryStateBackend

STORED = [
    state_key_prefix(5, b"abc") + b"\x01",
    state_key_prefix(300, b"") + b"\x02",
    state_key_prefix(7, "ключ".encode()) + b"\x03\x01map-key",
    state_key_prefix(7, b"xy") + b"\x03\x01",  # a map entry with an empty user key
    state_key_prefix(127, b"\x00\xff") + b"\x09",
]


def test_split_and_build_are_inverses() -> None:
    parts = split_stored_keys(pa.array(STORED, pa.binary()))
    assert parts.key_group.to_pylist() == [5, 300, 7, 7, 127]
    assert parts.key.to_pylist() == [b"abc", b"", "ключ".encode(), b"xy", b"\x00\xff"]
    assert parts.state_id.tolist() == [1, 2, 3, 3, 9]
    assert parts.map_key.to_pylist() == [None, None, b"map-key", b"", None]
    rebuilt = build_stored_keys(parts.key_group, parts.key, parts.state_id, parts.map_key)
    assert rebuilt.to_pylist() == STORED


def test_a_sliced_column_without_map_entries_splits_too() -> None:
    column = pa.array(STORED, pa.binary()).slice(4, 1)
    parts = split_stored_keys(column)
    assert parts.key.to_pylist() == [b"\x00\xff"]
    assert parts.map_key.to_pylist() == [None]


def test_a_truncated_stored_key_is_an_error() -> None:
    with pytest.raises(StateError, match="shorter"):
        split_stored_keys(pa.array([state_key_prefix(1, b"abcdef")[:-2] + b"\x01"]))


def _fill(backend: KeyedStateBackend, n: int) -> None:
    for i in range(n):
        key = f"k{i}".encode()
        backend.put(state_key_prefix(i % 128, key) + b"\x01", b"v%d" % i)
        if i % 10 == 0:
            backend.map_put(state_key_prefix(i % 128, key) + b"\x02", b"m%d" % i, b"x")


def test_export_and_bulk_load_keep_every_entry(
    make_backend: Callable[..., KeyedStateBackend],
) -> None:
    source = make_backend()
    _fill(source, 500)
    keys, values = source.export_arrays()
    assert len(keys) == len(values) == 550
    target = make_backend()
    target.load_arrays(keys, values)
    assert sorted(target.items()) == sorted(source.items())
    assert target.map_get(state_key_prefix(10, b"k10") + b"\x02", b"m10") == b"x"


def test_export_batches_hold_the_export_in_batches(
    make_backend: Callable[..., KeyedStateBackend],
) -> None:
    backend = make_backend()
    _fill(backend, 500)
    keys, values = backend.export_arrays()
    batches = list(backend.export_batches(128))
    assert pa.concat_arrays([k for k, _ in batches]).to_pylist() == keys.to_pylist()
    assert pa.concat_arrays([v for _, v in batches]).to_pylist() == values.to_pylist()
    if backend.exports_in_key_order:
        assert [len(k) for k, _ in batches] == [128, 128, 128, 128, 38]
        assert keys.to_pylist() == sorted(keys.to_pylist())


def test_memory_loads_in_key_order_or_not_snapshot_the_same(tmp_path: object) -> None:
    keys = sorted(state_key_prefix(i % 128, b"k%d" % i) + b"\x01" for i in range(300))
    storage = CheckpointStorage(str(tmp_path))
    for order, name in ((keys, "sorted"), (keys[::-1], "reversed"), (keys + keys[:5], "twice")):
        loaded = MemoryStateBackend()
        half = len(order) // 2
        loaded.load_arrays(pa.array(order[:half]), pa.array([b"a"] * half))
        loaded.load_arrays(pa.array(order[half:]), pa.array([b"b"] * (len(order) - half)))
        snap = loaded.snapshot(1)
        handle = snap.materialize(storage, name)
        restored = MemoryStateBackend()
        restored.restore(handle, storage)
        assert sorted(restored.items()) == sorted(loaded.items())
        assert restored.entry_count() == len(keys)


def test_bulk_load_of_a_key_twice_keeps_the_last(
    make_backend: Callable[..., KeyedStateBackend],
) -> None:
    key = state_key_prefix(3, b"k") + b"\x01"
    backend = make_backend()
    backend.load_arrays(pa.array([key, key]), pa.array([b"first", b"last"]))
    assert backend.get(key) == b"last"


def test_memory_snapshots_of_the_per_entry_format_restore(tmp_path: object) -> None:
    storage = CheckpointStorage(str(tmp_path))
    u32 = struct.Struct(">I").pack
    plain = state_key_prefix(1, b"a") + b"\x01"
    prefix = state_key_prefix(2, b"b") + b"\x02"
    data = (
        b"SLMEM1\n"
        + b"\x00" + u32(len(plain)) + plain + u32(2) + b"v1"
        + b"\x01" + u32(len(prefix)) + prefix + u32(2) + b"uk" + u32(2) + b"mv"
    )  # fmt: skip
    storage.write_bytes("old/state-memory.bin", data)
    handle = StateHandle(
        "memory", (StateFile("old/state-memory.bin", len(data), crc32_checksum(data)),)
    )
    backend = MemoryStateBackend()
    backend.restore(handle, storage)
    assert backend.get(plain) == b"v1"
    assert backend.map_get(prefix, b"uk") == b"mv"


def test_memory_snapshot_round_trip_in_columns(tmp_path: object) -> None:
    storage = CheckpointStorage(str(tmp_path))
    backend = MemoryStateBackend()
    _fill(backend, 1000)
    backend.put(state_key_prefix(0, b"") + b"\x01", b"")
    handle = backend.snapshot(1).materialize(storage, "chk-1")
    assert storage.read_bytes(handle.files[0].path).startswith(b"SLMEM2\n")
    restored = MemoryStateBackend()
    restored.restore(handle, storage)
    assert sorted(restored.items()) == sorted(backend.items())
    assert restored.entry_count() == backend.entry_count()


def test_memory_columns_stay_columns_until_single_entries_are_touched(tmp_path: object) -> None:
    storage = CheckpointStorage(str(tmp_path))
    first = state_key_prefix(1, b"a") + b"\x01"
    second = state_key_prefix(2, b"b") + b"\x01"
    backend = MemoryStateBackend()
    backend.load_arrays(pa.array([first, second]), pa.array([b"1", b"2"]))
    backend.load_arrays(pa.array([second]), pa.array([b"2 again"]))  # later loads win
    handle = backend.snapshot(1).materialize(storage, "chk-1")
    restored = MemoryStateBackend()
    restored.restore(handle, storage)
    keys, values = restored.export_arrays()
    assert dict(zip(keys.to_pylist(), values.to_pylist(), strict=True)) == {
        first: b"1",
        second: b"2 again",
    }
    restored.put(first, b"changed")
    assert restored.get(first) == b"changed"
    assert restored.get(second) == b"2 again"
    assert restored.entry_count() == 2
