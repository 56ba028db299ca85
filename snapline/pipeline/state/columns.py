"""Stored keys as Arrow columns: split ``key_group | len | key | state_id [| 0x01 | user key]``
into its parts and build it back, for whole columns at once (savepoint export and restore move
millions of entries; a Python loop per entry was most of their time).

Threads: any; the functions are pure, and ``bulk()`` may be entered by several at once.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from snapline.pipeline.errors import StateError

#: Bytes before the key: key-group (2, big-endian) and key length (4, big-endian).
HEADER = 6
#: The tag between a map's prefix and the user key of one of its entries.
MAP_TAG = 1


@dataclass(frozen=True)
class StoredKeys:
    """The parts of a column of stored keys (one row per entry)."""

    key_group: pa.Int32Array
    key: pa.Array
    state_id: np.ndarray
    #: The user key of a map entry, null for a plain value.
    map_key: pa.Array


class _Bulk:
    """How many threads are inside ``bulk()`` and whether the collector ran before the first
    entered: the collector's switch is per process, so the last one out restores it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.enabled = False


_BULK = _Bulk()


@contextlib.contextmanager
def bulk() -> Iterator[None]:
    """No cyclic garbage collection while whole columns become Python objects and back: the
    collector would walk every live container per ~700 allocations (measured: converting
    250k values took 10 x longer in a process holding a large state). Savepoint jobs run in
    threads side by side, each in and out of ``bulk()``."""
    with _BULK.lock:
        if _BULK.depth == 0:
            _BULK.enabled = gc.isenabled()
            gc.disable()
        _BULK.depth += 1
    try:
        yield
    finally:
        with _BULK.lock:
            _BULK.depth -= 1
            if _BULK.depth == 0 and _BULK.enabled:
                gc.enable()


def binary_buffers(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, data)`` of a binary array without nulls: row i is ``data[offsets[i]:
    offsets[i + 1]]``; offsets as int64, zero-copy where the layout allows."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if array.null_count:
        raise StateError("stored keys and values cannot be null")
    if pa.types.is_large_binary(array.type):
        width: type = np.int64
    elif pa.types.is_binary(array.type) or pa.types.is_string(array.type):
        width = np.int32
    else:
        raise StateError(f"expected a binary column, got {array.type}")
    n = len(array)
    _, offsets_buf, data_buf = array.buffers()
    offsets: np.ndarray = np.frombuffer(offsets_buf, dtype=width)
    offsets = offsets[array.offset : array.offset + n + 1]
    data = (
        np.frombuffer(data_buf, dtype=np.uint8)
        if data_buf is not None
        else np.zeros(0, dtype=np.uint8)
    )
    return offsets.astype(np.int64, copy=False), data


def binary_from_parts(offsets: np.ndarray, data: np.ndarray | bytes | memoryview) -> pa.Array:
    """A binary array from int64 offsets and its bytes (``large_binary`` beyond 2 GiB)."""
    n = len(offsets) - 1
    if offsets[-1] < 2**31 - 1:
        return pa.Array.from_buffers(
            pa.binary(), n, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)]
        )
    return pa.Array.from_buffers(
        pa.large_binary(), n, [None, pa.py_buffer(offsets.astype(np.int64)), pa.py_buffer(data)]
    )


def take_ranges(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """Row i is ``data[starts[i] : starts[i] + lengths[i]]`` (a gather of byte ranges)."""
    out_offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out_offsets[1:])
    total = int(out_offsets[-1])
    # Position j of the output comes from data[j + starts[i] - out_offsets[i]] in row i.
    shift = np.repeat(starts - out_offsets[:-1], lengths)
    shift += np.arange(total, dtype=np.int64)
    return binary_from_parts(out_offsets, data[shift])


def _parse(stored: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(data, starts, key_group, key_len)`` of a column of stored keys, validated."""
    offsets, data = binary_buffers(stored)
    starts = offsets[:-1]
    lengths = np.diff(offsets)
    if len(lengths) and int(lengths.min()) < HEADER + 1:
        raise StateError("a stored key is shorter than its key-group, length and state id")
    head = data[starts[:, None] + np.arange(HEADER)].astype(np.int64)
    key_group = (head[:, 0] << 8) | head[:, 1]
    key_len = (head[:, 2] << 24) | (head[:, 3] << 16) | (head[:, 4] << 8) | head[:, 5]
    if len(lengths) and bool((HEADER + key_len + 1 > lengths).any()):
        raise StateError("a stored key is shorter than the key length it records")
    return data, starts, key_group, key_len


def map_entries(stored: pa.Array) -> np.ndarray:
    """Which stored keys are map entries (bytes follow the state id)."""
    _, starts, _, key_len = _parse(stored)
    offsets, _ = binary_buffers(stored)
    return np.diff(offsets) > HEADER + key_len + 1


def split_stored_keys(stored: pa.Array) -> StoredKeys:
    """The key-group, key, state id and map user key of every stored key (the rocksdb layout:
    a map entry is its map's prefix, ``0x01`` and the user key)."""
    data, starts, key_group, key_len = _parse(stored)
    lengths = np.diff(binary_buffers(stored)[0])
    end = HEADER + key_len + 1  # past the state id
    state_id = data[starts + end - 1]
    is_map = lengths > end
    if bool(is_map.any()):
        if bool((data[starts[is_map] + end[is_map]] != MAP_TAG).any()):
            raise StateError("a stored key has bytes after its state id that are no map entry")
        key = take_ranges(data, starts + HEADER, key_len)
        map_len = np.where(is_map, lengths - end - 1, 0)
        map_key = take_ranges(data, starts + end + 1, map_len)
        map_key = pc.if_else(pa.array(is_map), map_key, pa.scalar(None, map_key.type))
    else:
        key = pc.binary_slice(stored, HEADER, -1)
        map_key = pa.nulls(len(stored), pa.binary())
    return StoredKeys(
        pa.array(key_group.astype(np.int32), type=pa.int32()),
        key.combine_chunks() if isinstance(key, pa.ChunkedArray) else key,
        state_id,
        map_key.combine_chunks() if isinstance(map_key, pa.ChunkedArray) else map_key,
    )


def build_stored_keys(
    key_group: pa.Array, key: pa.Array, state_id: np.ndarray, map_key: pa.Array | None
) -> pa.Array:
    """The stored key of every row (the inverse of ``split_stored_keys``)."""
    n = len(key)
    groups = np.asarray(pc.fill_null(key_group, 0).to_numpy(zero_copy_only=False), np.int64)
    if n and (int(groups.min()) < 0 or int(groups.max()) > 0xFFFF):
        raise StateError("a key-group does not fit the stored key's two bytes")
    key_len = np.asarray(pc.binary_length(key).to_numpy(zero_copy_only=False), np.int64)
    head = np.empty((n, HEADER + 1), dtype=np.uint8)
    head[:, 0] = groups >> 8
    head[:, 1] = groups & 0xFF
    head[:, 2:HEADER] = key_len.astype(">u4").view(np.uint8).reshape(n, 4)
    head[:, HEADER] = state_id
    # key_group | len, then the key, then the state id: join with an empty separator.
    header = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(HEADER), n, [None, pa.py_buffer(np.ascontiguousarray(head[:, :HEADER]))]
    ).cast(pa.binary())
    sid = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(1), n, [None, pa.py_buffer(np.ascontiguousarray(head[:, HEADER]))]
    ).cast(pa.binary())
    parts = [header, key, sid]
    if map_key is not None and map_key.null_count < n:
        tagged = pc.binary_join_element_wise(pa.scalar(bytes((MAP_TAG,))), map_key, b"")
        parts.append(pc.fill_null(tagged, b""))
    out = pc.binary_join_element_wise(*parts, b"")
    return out.combine_chunks() if isinstance(out, pa.ChunkedArray) else out
