"""The keyed state backend interface: a byte key-value store per task plus snapshot and restore.

Threads: the task thread owns a backend and calls every method except
``SnapshotHandle.materialize``, which a checkpoint thread runs on an immutable view.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from snapline.pipeline.checkpoint.storage import CheckpointStorage

if TYPE_CHECKING:
    import pyarrow as pa


@dataclass(frozen=True)
class StateFile:
    """One file of a materialized snapshot, relative to the job's checkpoint root."""

    path: str
    size: int
    checksum: str  # "crc32:<hex>"


@dataclass(frozen=True)
class StateHandle:
    """What a checkpoint's metadata records about one task's state: enough to restore it."""

    backend: str
    files: tuple[StateFile, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "files": [{"path": f.path, "size": f.size, "checksum": f.checksum} for f in self.files],
            "extra": self.extra,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> StateHandle:
        return StateHandle(
            backend=data["backend"],
            files=tuple(StateFile(f["path"], int(f["size"]), f["checksum"]) for f in data["files"]),
            extra=dict(data.get("extra", {})),
        )


class SnapshotHandle(ABC):
    """The result of the synchronous part of a snapshot: an immutable view to materialize."""

    @abstractmethod
    def materialize(self, storage: CheckpointStorage, directory: str) -> StateHandle:
        """Write the view to ``directory`` in storage (runs on a checkpoint thread)."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Free local resources held by the view (hard links, copies)."""


class KeyedStateBackend(ABC):
    """A task's keyed state as sorted-or-not byte keys; state types are built on top of it.

    Keys are ``key_group(2 bytes) | key_len(4) | key | state_id(1)``; map entries append the
    serialized user key. Backends only see bytes.
    """

    name: str = "abstract"
    #: Called between the files of a long restore (a RocksDB checkpoint's files are fetched
    #: one by one): the worker passes its liveness beat, so a restore of many gigabytes is
    #: not taken for a stalled task thread (the watchdog ended every attempt at its timeout,
    #: and the next attempt started over).
    progress: Callable[[], None] | None = None

    @abstractmethod
    def get(self, key: bytes) -> bytes | None: ...

    @abstractmethod
    def put(self, key: bytes, value: bytes) -> None: ...

    @abstractmethod
    def delete(self, key: bytes) -> None: ...

    @abstractmethod
    def map_get(self, prefix: bytes, user_key: bytes) -> bytes | None: ...

    @abstractmethod
    def map_put(self, prefix: bytes, user_key: bytes, value: bytes) -> None: ...

    @abstractmethod
    def map_delete(self, prefix: bytes, user_key: bytes) -> None: ...

    @abstractmethod
    def map_items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """All (user_key, value) pairs under ``prefix`` (order unspecified)."""

    @abstractmethod
    def map_clear(self, prefix: bytes) -> None: ...

    @abstractmethod
    def snapshot(self, checkpoint_id: int) -> SnapshotHandle:
        """Synchronous part of a snapshot: must be fast; returns an immutable view."""

    @abstractmethod
    def restore(self, handle: StateHandle, storage: CheckpointStorage) -> None:
        """Replace all state with the snapshot described by ``handle`` (checksums verified)."""

    def put_many(self, entries: list[tuple[bytes, bytes]]) -> None:
        """Bulk ``put`` (a restore): backends may batch the writes."""
        for key, value in entries:
            self.put(key, value)

    @abstractmethod
    def items(self) -> Iterator[tuple[bytes, bytes | None, bytes]]:
        """Every stored entry as (state key, map user key or None, value): for savepoints,
        which export state by key-group. Call it on a backend no task is writing to."""

    def export_arrays(self) -> tuple[pa.Array, pa.Array]:
        """Every stored entry as two binary columns, (stored key, value); a map entry's stored
        key is its map's prefix, ``0x01`` and the user key (the rocksdb layout). For
        savepoints, like ``items``; backends override it to skip the per-entry tuples."""
        import pyarrow as pa

        from snapline.pipeline.state.columns import MAP_TAG

        keys: list[bytes] = []
        values: list[bytes] = []
        tag = bytes((MAP_TAG,))
        for stored, user_key, value in self.items():
            keys.append(stored if user_key is None else stored + tag + user_key)
            values.append(value)
        return pa.array(keys, pa.binary()), pa.array(values, pa.binary())

    #: Whether ``export_batches`` yields the entries in stored-key (so key-group) order.
    exports_in_key_order = False

    def export_batches(self, rows: int) -> Iterator[tuple[pa.Array, pa.Array]]:
        """``export_arrays`` in batches of about ``rows`` entries, so a savepoint can write one
        batch while reading the next (here: one batch of everything)."""
        yield self.export_arrays()

    def load_arrays(self, stored: pa.Array, values: pa.Array) -> None:
        """Bulk write of columns in the layout of ``export_arrays`` (a savepoint restore);
        backends override it to write whole columns at once."""
        from snapline.pipeline.state.columns import map_entries

        keys = stored.to_pylist()
        data = values.to_pylist()
        mask = map_entries(stored)
        if not mask.any():
            self.put_many(list(zip(keys, data, strict=True)))
            return
        plain = []
        for key, value, is_map in zip(keys, data, mask.tolist(), strict=True):
            if is_map:
                end = 7 + int.from_bytes(key[2:6], "big")
                self.map_put(key[:end], key[end + 1 :], value)
            else:
                plain.append((key, value))
        self.put_many(plain)

    def delete_where(self, predicate: Callable[[bytes, bytes], bool]) -> int:
        """Delete every entry for which ``predicate(stored key, value)`` holds (for a map
        entry, the stored key is the map's prefix); returns how many. State TTL's sweep."""
        raise NotImplementedError(f"the {self.name} backend cannot sweep expired state")

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; local files of a task that moved away are deleted."""

    def entry_count(self) -> int:
        """Number of stored entries (for metrics and tests); backends may estimate."""
        return -1
