"""The ``memory`` state backend: Python dicts of bytes; snapshot = copy, then serialize off-thread.

Threads: the task thread owns the live dicts. ``snapshot`` (task thread) takes shallow
copies — values are immutable ``bytes`` so a shallow copy is a consistent view — and
``MemorySnapshot.materialize`` (checkpoint thread) serializes and writes that view.

Snapshot file: ``SLMEM2`` stores columns (every length, then every key and value
back to back) so encoding and decoding are a few whole-column operations instead of a Python
loop per entry; ``SLMEM1`` files (one record per entry) of earlier versions are still read.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Iterator
from itertools import repeat
from typing import TYPE_CHECKING

from snapline.pipeline.checkpoint.storage import CheckpointStorage, verify_checksum
from snapline.pipeline.errors import CorruptCheckpointError
from snapline.pipeline.state.backend import (
    KeyedStateBackend,
    SnapshotHandle,
    StateFile,
    StateHandle,
)

if TYPE_CHECKING:
    import pyarrow as pa

# numpy and pyarrow (columns) load on first use, in a checkpoint, restore or savepoint: a
# worker starts without them (part of recovery time).

_MAGIC = b"SLMEM1\n"
_MAGIC2 = b"SLMEM2\n"
_U32 = struct.Struct(">I")
#: SLMEM2 header: number of plain values, number of map entries.
_COUNTS = struct.Struct("<QQ")
_VALUE, _MAP = 0, 1
_BIG_ENDIAN = sys.byteorder == "big"
#: An ``array`` type code of 4-byte unsigned integers (SLMEM2 lengths).
_U32_CODE = "I" if array("I").itemsize == 4 else "L"
STATE_FILE = "state-memory.bin"


class MemorySnapshot(SnapshotHandle):
    def __init__(
        self,
        values: dict[bytes, bytes],
        maps: dict[bytes, dict[bytes, bytes]],
        columns: tuple[pa.Array, pa.Array] | None = None,
    ) -> None:
        self._values = values
        self._maps = maps
        #: Plain values as (stored keys, values) columns, instead of ``values``.
        self._columns = columns

    def encode(self) -> bytes:
        return b"".join(self.encode_parts())

    def encode_parts(self) -> list[memoryview]:
        """``SLMEM2``: counts; the lengths (u32 little-endian) of the plain values' keys and
        values, the map entries' prefixes, user keys and values; then those five columns."""
        if self._columns is not None:
            return self._encode_arrow(self._columns)
        prefixes: list[bytes] = []
        user_keys: list[bytes] = []
        map_values: list[bytes] = []
        for prefix, entries in self._maps.items():
            prefixes.extend(repeat(prefix, len(entries)))
            user_keys.extend(entries)
            map_values.extend(entries.values())
        columns = [list(self._values), list(self._values.values()), prefixes, user_keys, map_values]
        # Dicts of bytes (the checkpoint of every running job): ``array`` and ``bytes.join``
        # build each column in C without numpy or pyarrow, which a worker never imports for
        # this (their import on the first checkpoint cost ~0.7 s and ~70 MB of RSS).
        parts = [memoryview(_MAGIC2 + _COUNTS.pack(len(columns[0]), len(prefixes)))]
        for column in columns:
            lengths = array(_U32_CODE, map(len, column))
            if _BIG_ENDIAN:
                lengths.byteswap()
            parts.append(memoryview(lengths).cast("B"))
        return parts + [memoryview(b"".join(column)) for column in columns]

    @staticmethod
    def _encode_arrow(plain: tuple[pa.Array, pa.Array]) -> list[memoryview]:
        """The same layout from restored or loaded columns (no map entries)."""
        import numpy as np
        import pyarrow as pa

        from snapline.pipeline.state.columns import binary_buffers

        empty = pa.array([], pa.large_binary())
        columns = [*plain, empty, empty, empty]
        parts = [memoryview(_MAGIC2 + _COUNTS.pack(len(columns[0]), 0))]
        blobs = []
        for column in columns:
            offsets, data = binary_buffers(column)
            parts.append(np.diff(offsets).astype("<u4").data)
            blobs.append(data[offsets[0] : offsets[-1]].data)
        return parts + blobs

    def materialize(self, storage: CheckpointStorage, directory: str) -> StateHandle:
        path = f"{directory}/{STATE_FILE}"
        size, checksum = storage.write_parts(path, self.encode_parts())
        return StateHandle("memory", (StateFile(path, size, checksum),))


def _read_columns(data: bytes, what: str) -> list[pa.Array]:
    """The five columns of an ``SLMEM2`` file, zero-copy over ``data``."""
    import numpy as np

    from snapline.pipeline.state.columns import binary_from_parts

    try:
        n_values, n_maps = _COUNTS.unpack_from(data, len(_MAGIC2))
        pos = len(_MAGIC2) + _COUNTS.size
        lengths = []
        for count in (n_values, n_values, n_maps, n_maps, n_maps):
            lengths.append(np.frombuffer(data, dtype="<u4", count=count, offset=pos))
            pos += 4 * count
    except (struct.error, ValueError) as exc:
        raise CorruptCheckpointError(f"{what} is truncated") from exc
    view = memoryview(data)
    columns = []
    for column_lengths in lengths:
        offsets = np.zeros(len(column_lengths) + 1, dtype=np.int64)
        np.cumsum(column_lengths, out=offsets[1:])
        total = int(offsets[-1])
        if pos + total > len(data):
            raise CorruptCheckpointError(f"{what} is truncated")
        columns.append(binary_from_parts(offsets, view[pos : pos + total]))
        pos += total
    if pos != len(data):
        raise CorruptCheckpointError(f"{what} has {len(data) - pos} bytes after its entries")
    return columns


def _decode_columns(
    data: bytes, what: str
) -> tuple[dict[bytes, bytes], dict[bytes, dict[bytes, bytes]]]:
    from snapline.pipeline.state.columns import bulk

    keys, values, prefixes, user_keys, map_values = _read_columns(data, what)
    with bulk():
        plain = dict(zip(keys.to_pylist(), values.to_pylist(), strict=True))
        maps: dict[bytes, dict[bytes, bytes]] = {}
        for prefix, user_key, value in zip(
            prefixes.to_pylist(), user_keys.to_pylist(), map_values.to_pylist(), strict=True
        ):
            entries = maps.get(prefix)
            if entries is None:
                entries = maps[prefix] = {}
            entries[user_key] = value
    return plain, maps


def decode_memory_snapshot(
    data: bytes, what: str
) -> tuple[dict[bytes, bytes], dict[bytes, dict[bytes, bytes]]]:

    if data.startswith(_MAGIC2):
        return _decode_columns(data, what)
    if not data.startswith(_MAGIC):
        raise CorruptCheckpointError(f"{what} is not a Snapline memory snapshot")
    values: dict[bytes, bytes] = {}
    maps: dict[bytes, dict[bytes, bytes]] = {}
    view = memoryview(data)
    pos = len(_MAGIC)
    unpack = _U32.unpack_from
    try:
        while pos < len(data):
            kind = data[pos]
            pos += 1
            (n,) = unpack(data, pos)
            pos += 4
            key = bytes(view[pos : pos + n])
            pos += n
            if kind == _MAP:
                (n,) = unpack(data, pos)
                pos += 4
                ukey = bytes(view[pos : pos + n])
                pos += n
            (n,) = unpack(data, pos)
            pos += 4
            value = bytes(view[pos : pos + n])
            pos += n
            if kind == _VALUE:
                values[key] = value
            elif kind == _MAP:
                maps.setdefault(key, {})[ukey] = value
            else:
                raise CorruptCheckpointError(f"{what}: unknown entry kind {kind}")
    except struct.error as exc:
        raise CorruptCheckpointError(f"{what} is truncated") from exc
    return values, maps


class MemoryStateBackend(KeyedStateBackend):
    """All state of a task in two dicts: plain values and per-key maps.

    A restore or a bulk load keeps plain values as Arrow columns until something reads or
    writes single entries (then they move into the dict): a savepoint's export or load
    followed by a snapshot never makes a Python object per entry.
    """

    name = "memory"

    def __init__(self) -> None:

        self._values: dict[bytes, bytes] = {}
        self._maps: dict[bytes, dict[bytes, bytes]] = {}
        #: Plain values as (stored keys, values) columns, newer than the dicts' entries.
        self._columns: list[tuple[pa.Array, pa.Array]] = []
        #: What is known of the columns' keys, so a snapshot or an export need not hash them
        #: all to find a repeated one: none repeats (``_distinct``); and, when they are in
        #: strictly increasing order as well, the last one (``_last_key``).
        self._distinct = False
        self._last_key: bytes | None = None

    def _settle(self) -> None:
        """Move the column entries into the dict (in order: later ones win)."""
        from snapline.pipeline.state.columns import bulk

        columns, self._columns = self._columns, []
        self._distinct, self._last_key = False, None
        with bulk():
            for keys, values in columns:
                self._values.update(zip(keys.to_pylist(), values.to_pylist(), strict=True))

    def _only_columns(self) -> tuple[pa.Array, pa.Array] | None:
        """All state as one pair of columns, when that is all there is and no key repeats."""
        if self._values or self._maps or not self._columns:
            return None
        import pyarrow as pa
        import pyarrow.compute as pc

        if len(self._columns) == 1:
            keys, values = self._columns[0]
        else:
            keys = pa.concat_arrays([k for k, _ in self._columns])
            values = pa.concat_arrays([v for _, v in self._columns])
        if not self._distinct:
            # pc.unique hashes about 2.5 x faster than pc.count_distinct (measured, 250k keys).
            if len(keys) > 1 and len(pc.unique(keys)) != len(keys):
                return None
            self._distinct = True
        self._columns = [(keys, values)]
        return keys, values

    def get(self, key: bytes) -> bytes | None:
        if self._columns:
            self._settle()
        return self._values.get(key)

    def put(self, key: bytes, value: bytes) -> None:
        if self._columns:
            self._settle()
        self._values[key] = value

    def delete(self, key: bytes) -> None:
        if self._columns:
            self._settle()
        self._values.pop(key, None)

    def map_get(self, prefix: bytes, user_key: bytes) -> bytes | None:
        entries = self._maps.get(prefix)
        return None if entries is None else entries.get(user_key)

    def map_put(self, prefix: bytes, user_key: bytes, value: bytes) -> None:
        entries = self._maps.get(prefix)
        if entries is None:
            entries = self._maps[prefix] = {}
        entries[user_key] = value

    def map_delete(self, prefix: bytes, user_key: bytes) -> None:
        entries = self._maps.get(prefix)
        if entries is not None:
            entries.pop(user_key, None)
            if not entries:
                del self._maps[prefix]

    def map_items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return iter(list(self._maps.get(prefix, {}).items()))

    def map_clear(self, prefix: bytes) -> None:
        self._maps.pop(prefix, None)

    def delete_where(self, predicate: Callable[[bytes, bytes], bool]) -> int:
        if self._columns:
            self._settle()
        dead = [k for k, v in self._values.items() if predicate(k, v)]
        for key in dead:
            del self._values[key]
        count = len(dead)
        for prefix, entries in list(self._maps.items()):
            gone = [u for u, v in entries.items() if predicate(prefix, v)]
            for user_key in gone:
                del entries[user_key]
            if not entries:
                del self._maps[prefix]
            count += len(gone)
        return count

    def snapshot(self, checkpoint_id: int) -> MemorySnapshot:
        columns = self._only_columns()
        if columns is not None:
            return MemorySnapshot({}, {}, columns)
        if self._columns:
            self._settle()
        return MemorySnapshot(self._values.copy(), {p: m.copy() for p, m in self._maps.items()})

    def restore(self, handle: StateHandle, storage: CheckpointStorage) -> None:
        (state_file,) = handle.files
        try:
            with storage.open_input(state_file.path) as fh:
                data = bytes(fh.read())
        except FileNotFoundError as exc:
            # Corrupt, not just unreadable: on_corrupt_checkpoint="rewind" may then restore an
            # earlier committed checkpoint, as it does for a missing RocksDB file.
            raise CorruptCheckpointError(
                f"memory state file {storage.full_path(state_file.path)} is missing from "
                "checkpoint storage"
            ) from exc
        verify_checksum(data, state_file.checksum, f"state file {state_file.path}")
        self._columns = []
        self._distinct, self._last_key = False, None
        if data.startswith(_MAGIC2):
            keys, values, prefixes, _, _ = _read_columns(data, state_file.path)
            if not len(prefixes):  # the common case: no map state
                self._values, self._maps = {}, {}
                self._columns = [(keys, values)]
                # Every SLMEM2 writer holds distinct keys: a dict's, or columns checked so.
                self._distinct = True
                return
        self._values, self._maps = decode_memory_snapshot(data, state_file.path)

    def entry_count(self) -> int:
        """Exact, except while restored or loaded columns are not yet settled into the dict:
        a key in two of them, or in one and the dict, then counts twice (an upper bound).
        Metrics sample this every second, so it never settles them (undoing their fast path)."""
        count = len(self._values) + sum(len(m) for m in self._maps.values())
        return count + sum(len(keys) for keys, _ in self._columns)

    def put_many(self, entries: list[tuple[bytes, bytes]]) -> None:
        if self._columns:
            self._settle()
        self._values.update(entries)

    def export_arrays(self) -> tuple[pa.Array, pa.Array]:
        import pyarrow as pa

        from snapline.pipeline.state.columns import MAP_TAG, bulk

        columns = self._only_columns()
        if columns is not None:
            return columns
        if self._columns:
            self._settle()
        with bulk():
            keys = pa.array(list(self._values), pa.binary())
            values = pa.array(list(self._values.values()), pa.binary())
        if not self._maps:
            return keys, values
        tag = bytes((MAP_TAG,))
        map_keys = [p + tag + u for p, entries in self._maps.items() for u in entries]
        map_values = [v for entries in self._maps.values() for v in entries.values()]
        return (
            pa.concat_arrays([keys, pa.array(map_keys, pa.binary())]),
            pa.concat_arrays([values, pa.array(map_values, pa.binary())]),
        )

    def load_arrays(self, stored: pa.Array, values: pa.Array) -> None:
        import pyarrow.compute as pc

        from snapline.pipeline.state.columns import map_entries

        if map_entries(stored).any():
            if self._columns:
                self._settle()
            super().load_arrays(stored, values)
            return
        if not len(stored):
            return
        # Rows in strictly increasing key order (a rocksdb export's, a restore's whose rows
        # were) cannot repeat a key: a comparison of neighbours, no hashing.
        increasing = (
            len(stored) == 1
            or not pc.any(pc.less_equal(stored.slice(1), stored.slice(0, len(stored) - 1))).as_py()
        )
        first, last = stored[0].as_py(), stored[-1].as_py()
        after = not self._columns or (self._last_key is not None and first > self._last_key)
        self._distinct = increasing and after and (self._distinct or not self._columns)
        self._last_key = last if increasing and after else None
        self._columns.append((stored, values))

    def items(self) -> Iterator[tuple[bytes, bytes | None, bytes]]:
        if self._columns:
            self._settle()
        for key, value in self._values.items():
            yield key, None, value
        for prefix, entries in self._maps.items():
            for user_key, value in entries.items():
                yield prefix, user_key, value
