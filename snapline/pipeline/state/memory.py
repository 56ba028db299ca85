"""The ``memory`` state backend: Python dicts of bytes; snapshot = copy, then serialize off-thread.

Threads: the task thread owns the live dicts. ``snapshot`` (task thread) takes shallow
copies — values are immutable ``bytes`` so a shallow copy is a consistent view — and
``MemorySnapshot.materialize`` (checkpoint thread) serializes and writes that view.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

from snapline.pipeline.checkpoint.storage import CheckpointStorage, crc32_checksum, verify_checksum
from snapline.pipeline.errors import CorruptCheckpointError
from snapline.pipeline.state.backend import (
    KeyedStateBackend,
    SnapshotHandle,
    StateFile,
    StateHandle,
)

_MAGIC = b"SLMEM1\n"
_U32 = struct.Struct(">I")
_VALUE, _MAP = 0, 1
STATE_FILE = "state-memory.bin"


class MemorySnapshot(SnapshotHandle):
    def __init__(self, values: dict[bytes, bytes], maps: dict[bytes, dict[bytes, bytes]]) -> None:
        self._values = values
        self._maps = maps

    def encode(self) -> bytes:
        pack = _U32.pack
        parts: list[bytes] = [_MAGIC]
        append = parts.append
        for key, value in self._values.items():
            append(b"\x00" + pack(len(key)) + key + pack(len(value)) + value)
        for prefix, entries in self._maps.items():
            for ukey, value in entries.items():
                append(
                    b"\x01"
                    + pack(len(prefix))
                    + prefix
                    + pack(len(ukey))
                    + ukey
                    + pack(len(value))
                    + value
                )
        return b"".join(parts)

    def materialize(self, storage: CheckpointStorage, directory: str) -> StateHandle:
        data = self.encode()
        path = f"{directory}/{STATE_FILE}"
        storage.write_bytes(path, data)
        return StateHandle("memory", (StateFile(path, len(data), crc32_checksum(data)),))


def decode_memory_snapshot(
    data: bytes, what: str
) -> tuple[dict[bytes, bytes], dict[bytes, dict[bytes, bytes]]]:
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
    """All state of a task in two dicts: plain values and per-key maps."""

    name = "memory"

    def __init__(self) -> None:
        self._values: dict[bytes, bytes] = {}
        self._maps: dict[bytes, dict[bytes, bytes]] = {}

    def get(self, key: bytes) -> bytes | None:
        return self._values.get(key)

    def put(self, key: bytes, value: bytes) -> None:
        self._values[key] = value

    def delete(self, key: bytes) -> None:
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
        return MemorySnapshot(self._values.copy(), {p: m.copy() for p, m in self._maps.items()})

    def restore(self, handle: StateHandle, storage: CheckpointStorage) -> None:
        (state_file,) = handle.files
        data = storage.read_bytes(state_file.path)
        verify_checksum(data, state_file.checksum, f"state file {state_file.path}")
        self._values, self._maps = decode_memory_snapshot(data, state_file.path)

    def entry_count(self) -> int:
        return len(self._values) + sum(len(m) for m in self._maps.values())

    def put_many(self, entries: list[tuple[bytes, bytes]]) -> None:
        self._values.update(entries)

    def items(self) -> Iterator[tuple[bytes, bytes | None, bytes]]:
        for key, value in self._values.items():
            yield key, None, value
        for prefix, entries in self._maps.items():
            for user_key, value in entries.items():
                yield prefix, user_key, value
