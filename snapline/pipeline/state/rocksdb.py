"""The ``rocksdb`` state backend: one RocksDB database per task, asynchronous incremental
checkpoints (a hard-link RocksDB checkpoint, then new SST files only), verified fast restore.

Threads
    The task thread owns the database: every get/put/map operation, ``snapshot`` (the
    synchronous part: the epoch's buffered writes reach the database, as one ingested SST file
    when there are many; RocksDB flushes the memtable and hard-links the live files into
    ``<task_dir>/checkpoints/chk-<n>-<token>``; nothing else), ``restore`` and ``close``.
    A checkpoint thread runs ``RocksDBSnapshot.materialize``: it reads only that hard-linked
    directory, whose files are immutable, uploads the SST files storage does not hold yet to
    ``<job>/tasks/<task>/shared/``, the small private files (MANIFEST, CURRENT, OPTIONS) to the
    checkpoint's own directory, and a manifest of every file with size and CRC-32. ``release``
    (same checkpoint thread) removes the hard links, or keeps the newest for local recovery.
    The one object both threads touch is the locked ``SharedFileRegistry``.

Write-ahead log
    Disabled by default (``disable_wal=True``). State is only ever recovered from a completed
    checkpoint, never from the local database after a crash: a restarted task always restores
    the checkpoint its committed Kafka offsets name, and RocksDB's checkpoint flushes the
    memtable itself, so a WAL would be written and never read.

Key layout
    A plain value lives under its key ``key_group(2) | len(4) | key | state_id(1)``; a map entry
    under ``prefix | 0x01 | user_key``. Keys built that way are self-delimiting, so a value key
    never equals a map entry key and one map's entries never fall into another map's range.
    Every key starts with its key-group, so a key-group range is one contiguous key range.

Corrupt checkpoints
    Restore verifies the size and CRC-32 of every file and raises ``CorruptCheckpointError``
    naming the first missing or corrupt file. What happens next is the runtime's rule (DESIGN
    §3): the committed Kafka offsets name checkpoint c, and only c's state is consistent with
    the outputs already committed. An earlier checkpoint c' < c is consistent with the *input*
    only if the input is rewound to c''s barrier positions, and then the outputs of the span
    (c', c] are produced a second time: Kafka already committed them (read_committed consumers
    see duplicates) and sinks fenced by checkpoint id may drop or overwrite them. So by default
    the task FAILS with an error naming the file; ``on_corrupt_checkpoint="rewind"`` is the
    explicit opt-in to restore the newest readable earlier checkpoint and accept at-least-once
    delivery for that span. See docs/state-backends.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import rocksdict

from snapline.pipeline.checkpoint.incremental import (
    FetchResult,
    SharedFileRegistry,
    UploadResult,
    discard_unreferenced_files,
    fetch_files,
    local_name,
    upload_incremental,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, CorruptCheckpointError, StateError
from snapline.pipeline.state.backend import KeyedStateBackend, SnapshotHandle, StateHandle
from snapline.pipeline.state.rocksdb_options import (
    RocksDBOptions,
    RocksDBResources,
    build_db_options,
)

__all__ = [
    "RocksDBResources",
    "RocksDBOptions",
    "RocksDBSnapshot",
    "RocksDBStateBackend",
    "discard_unreferenced_files",
]

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

BACKEND_NAME = "rocksdb"
_MAP_TAG = b"\x01"
_KEY_LEN = struct.Struct(">I")
_MAP_END = b"\x02"
#: Buffered writes of the open epoch flushed to RocksDB once this many keys are pending.
WRITE_BUFFER_ENTRIES = 100_000
#: A flush of at least this many buffered writes (the snapshot's, mostly) reaches RocksDB as
#: one SST file written in key order and ingested, not through the memtable: a checkpoint
#: then has no memtable to flush. Measured, the snapshot pause (median of 22 epochs, two runs)
#: with 2,500 / 12,500 / 50,000 keys written in the epoch: through a write batch 7.3-8.0 /
#: 22.5-24.7 / 64-70 ms, ingested 6.3-8.7 / 17.0-17.7 / 49-56 ms.
SST_FLUSH_ENTRIES = 5_000
#: Values read from or written to the database that a task keeps in a dict for its next
#: reads (a running total reads every key it updates; a read through rocksdict costs ~1 µs
#: more than a dict's). When full it is emptied and fills again with what is read.
READ_CACHE_ENTRIES = 32_768
_MISSING = object()


def _is_sst(name: str) -> bool:
    return name.endswith(".sst")


class _LocalCheckpoints:
    """Hard-link checkpoint directories kept on local disk for local recovery (locked).

    Once a checkpoint of this instance is materialized, the files of an earlier process
    (``previous``) have no use left and are deleted.
    """

    def __init__(self, keep: int, previous_dir: Path) -> None:
        self._keep = keep
        self._previous_dir = previous_dir
        self._lock = threading.Lock()
        self._kept: list[tuple[int, Path]] = []

    def release(self, checkpoint_id: int, path: Path, materialized: bool) -> None:
        drop = [path]
        if materialized:
            drop.append(self._previous_dir)
            if self._keep > 0:
                with self._lock:
                    self._kept.append((checkpoint_id, path))
                    self._kept.sort()
                    drop = [p for _, p in self._kept[: -self._keep]] + [self._previous_dir]
                    self._kept = self._kept[-self._keep :]
        for p in drop:
            shutil.rmtree(p, ignore_errors=True)


class RocksDBSnapshot(SnapshotHandle):
    """A hard-linked RocksDB checkpoint directory, immutable, waiting to be materialized."""

    def __init__(
        self,
        checkpoint_id: int,
        local_dir: Path,
        registry: SharedFileRegistry,
        local: _LocalCheckpoints,
        transfer_threads: int,
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self.local_dir = local_dir
        self._registry = registry
        self._local = local
        self._threads = transfer_threads
        self._materialized = False
        self._released = False
        #: Set by ``materialize``: bytes and files uploaded versus reused (for metrics).
        self.result: UploadResult | None = None

    def materialize(self, storage: CheckpointStorage, directory: str) -> StateHandle:
        if self._released:
            raise CheckpointError(f"snapshot {self.checkpoint_id} was released before upload")
        started = time.perf_counter()
        result = upload_incremental(
            storage,
            self.local_dir,
            directory,
            self.checkpoint_id,
            self._registry,
            backend=BACKEND_NAME,
            is_shared=_is_sst,
            threads=self._threads,
        )
        self.result = result
        self._materialized = True
        log.debug(
            "checkpoint %d materialized in %.3fs: %d new files (%d bytes), %d reused (%d bytes)",
            self.checkpoint_id,
            time.perf_counter() - started,
            result.uploaded_files,
            result.uploaded_bytes,
            result.reused_files,
            result.reused_bytes,
        )
        return result.handle

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._local.release(self.checkpoint_id, self.local_dir, self._materialized)


class RocksDBStateBackend(KeyedStateBackend):
    """A task's keyed state in one RocksDB database under ``<task_dir>/db``.

    ``options`` are the fields of ``RocksDBOptions`` as keywords (``write_buffer_bytes=...``);
    ``shared_cache`` is the worker's ``RocksDBResources`` (or a bare ``rocksdict.Cache``) so
    all tasks of a worker share one block cache.
    """

    name = BACKEND_NAME

    def __init__(self, task_dir: str | Path, *, shared_cache: Any = None, **options: Any) -> None:
        self.options = RocksDBOptions.from_kwargs(options)
        if isinstance(shared_cache, rocksdict.Cache):
            shared_cache = RocksDBResources(cache=shared_cache)
        if shared_cache is not None and not isinstance(shared_cache, RocksDBResources):
            raise StateError(
                f"shared_cache must be a RocksDBResources (or rocksdict.Cache), got "
                f"{type(shared_cache).__name__}"
            )
        self.resources: RocksDBResources | None = shared_cache
        self.task_dir = Path(task_dir)
        self.db_dir = self.task_dir / "db"
        self.checkpoints_dir = self.task_dir / "checkpoints"
        self.previous_dir = self.task_dir / "previous"
        self._registry = SharedFileRegistry()
        self._local = _LocalCheckpoints(self.options.local_checkpoints_kept, self.previous_dir)
        self._write_options = rocksdict.WriteOptions()
        # A property at runtime although the stub declares a method.
        self._write_options.disable_wal = self.options.disable_wal  # type: ignore[method-assign,assignment]
        #: Statistics of the last ``restore`` and the pause of the last ``snapshot``.
        self.last_restore: FetchResult | None = None
        self.last_snapshot_pause: float = 0.0
        self.task_dir.mkdir(parents=True, exist_ok=True)
        self._stash_previous_incarnation()
        self.checkpoints_dir.mkdir(exist_ok=True)
        self._db: Any = self._open()
        self._sst_options = build_db_options(self.options, self.resources)
        self._ingest_options = rocksdict.IngestExternalFileOptions()
        self._ingest_options.set_move_files(True)
        #: Writes of the open epoch not yet in the database (None: a delete). Reads look here
        #: first; a key written by many records between two checkpoints reaches RocksDB once,
        #: at the snapshot (or when the buffer is full), in one write batch or SST file.
        self._pending: dict[bytes, bytes | None] = {}
        #: A delete is among the buffered writes (None values in ``_pending``).
        self._deleted = False
        #: Values equal to the database's (None: absent), for reads: READ_CACHE_ENTRIES.
        #: Emptied by anything that writes to the database other than ``flush_writes``.
        self._cache: dict[bytes, bytes | None] = {}

    # ------------------------------------------------------------------ lifecycle
    def _stash_previous_incarnation(self) -> None:
        """Files left by an earlier process become local-recovery sources, never live state.

        A fresh backend must start empty: only ``restore`` decides what state a task has.
        """
        # A restore or a flush (``_ingest_sorted``) interrupted by a crash: the database never took
        # these files.
        for staging in [*self.task_dir.glob("restore-*"), *self.task_dir.glob("flush-*")]:
            shutil.rmtree(staging, ignore_errors=True)
        leftovers = [p for p in (self.db_dir, self.checkpoints_dir) if p.exists()]
        if not leftovers:
            return
        target = self.previous_dir / uuid.uuid4().hex[:8]
        target.mkdir(parents=True)
        for path in leftovers:
            path.rename(target / path.name)

    def _open(self) -> rocksdict.Rdict:
        options = build_db_options(self.options, self.resources)
        # Named explicitly: opening an existing database (a restored checkpoint), rocksdict
        # otherwise takes the column family's options from the database's OPTIONS file, so
        # this backend's (its shared block cache, ``auto_compactions=False`` of a savepoint's
        # scratch backend: it compacted every restored checkpoint) would be ignored.
        db = rocksdict.Rdict(str(self.db_dir), options, column_families={"default": options})
        db.set_write_options(self._write_options)
        return db

    @property
    def db(self) -> rocksdict.Rdict:
        """The live database with every buffered write in it (task thread only); the caller
        may write to it, so the read cache starts over."""
        self.flush_writes()
        self._cache.clear()
        return self._db

    def close(self, *, delete: bool = False) -> None:
        """Close the database. Local files stay for local recovery unless ``delete``.
        Buffered writes are dropped: they belong to an epoch no checkpoint holds."""
        self._pending.clear()
        self._deleted = False
        self._cache.clear()
        if not isinstance(self._db, _ClosedDB):
            self._db.close()
            self._db = _ClosedDB(self.task_dir)
        if delete:
            shutil.rmtree(self.task_dir, ignore_errors=True)

    def destroy(self) -> None:
        """Close and delete every local file of the task (it moved to another worker)."""
        self.close(delete=True)

    # ------------------------------------------------------------------ values
    def get(self, key: bytes) -> bytes | None:
        value = self._pending.get(key, _MISSING)
        if value is not _MISSING:
            return value  # type: ignore[return-value]
        cache = self._cache
        value = cache.get(key, _MISSING)
        if value is not _MISSING:
            return value  # type: ignore[return-value]
        value = self._db.get(key)
        if len(cache) >= READ_CACHE_ENTRIES:
            cache.clear()
        cache[key] = value
        return value

    def put(self, key: bytes, value: bytes) -> None:
        pending = self._pending
        pending[key] = value
        if len(pending) >= WRITE_BUFFER_ENTRIES:
            self.flush_writes()

    def delete(self, key: bytes) -> None:
        pending = self._pending
        pending[key] = None
        self._deleted = True
        if len(pending) >= WRITE_BUFFER_ENTRIES:
            self.flush_writes()

    def flush_writes(self) -> None:
        """Write the buffered writes to the database, in one write batch or, when there are
        ``SST_FLUSH_ENTRIES`` or more, as one ingested SST file (before anything that iterates
        the database or snapshots it)."""
        pending = self._pending
        if not pending:
            return
        if len(pending) < SST_FLUSH_ENTRIES:
            batch = rocksdict.WriteBatch(raw_mode=True)
            for key, value in pending.items():
                if value is None:
                    batch.delete(key)
                else:
                    batch.put(key, value)
            self._db.write(batch, self._write_options)
        else:
            # Many writes: the puts go in as one SST file in key order (``_ingest_sorted``),
            # the deletes through a write batch (an SST file of ours holds no tombstones).
            # Keys are distinct, so the order between the two does not matter. Only the keys
            # are sorted, and the values are looked up as the file is written: no list of
            # pairs to build, sort and unzip (a snapshot's flush is most of its pause).
            puts: dict[bytes, bytes]
            if self._deleted:
                batch = rocksdict.WriteBatch(raw_mode=True)
                puts = {}
                for key, value in pending.items():
                    if value is None:
                        batch.delete(key)
                    else:
                        puts[key] = value
                if not batch.is_empty():
                    self._db.write(batch, self._write_options)
            else:
                puts = cast(dict[bytes, bytes], pending)  # no None among the values
            if puts:
                keys = sorted(puts)
                self._ingest_sorted(self._db, "flush", keys, map(puts.__getitem__, keys))
        self._deleted = False
        # What was written is what the next reads find. When the cache would overflow, it
        # starts over with just that: the written dict becomes the cache (no copy).
        cache = self._cache
        if len(cache) + len(pending) <= READ_CACHE_ENTRIES:
            cache.update(pending)
            pending.clear()
        elif len(pending) <= READ_CACHE_ENTRIES:
            self._cache, self._pending = pending, {}
        else:
            cache.clear()
            pending.clear()

    def _ingest_sorted(
        self, db: Any, staging: str, keys: Iterable[bytes], values: Iterable[bytes]
    ) -> None:
        """Write the entries (keys strictly increasing) as one SST file in a staging
        directory of the task (``<staging>-<token>``, removed after, and at the next start if
        a crash left it) and ingest it into ``db``, moving the file."""
        directory = self.task_dir / f"{staging}-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        try:
            path = str(directory / "entries.sst")
            writer = rocksdict.SstFileWriter(self._sst_options)
            writer.open(path)
            deque(map(writer.__setitem__, keys, values), maxlen=0)
            writer.finish()
            db.ingest_external_file([path], self._ingest_options)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------------ maps
    def map_get(self, prefix: bytes, user_key: bytes) -> bytes | None:
        return self.get(prefix + _MAP_TAG + user_key)

    def map_put(self, prefix: bytes, user_key: bytes, value: bytes) -> None:
        self.put(prefix + _MAP_TAG + user_key, value)

    def map_delete(self, prefix: bytes, user_key: bytes) -> None:
        self.delete(prefix + _MAP_TAG + user_key)

    def _map_range(self, prefix: bytes) -> tuple[bytes, rocksdict.ReadOptions]:
        read = rocksdict.ReadOptions()
        read.set_iterate_upper_bound(prefix + _MAP_END)
        return prefix + _MAP_TAG, read

    def map_items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        self.flush_writes()
        start, read = self._map_range(prefix)
        skip = len(start)
        # A list, like the memory backend: callers may mutate the map while iterating.
        items = cast(Iterator[tuple[bytes, bytes]], self._db.items(from_key=start, read_opt=read))
        return iter([(k[skip:], v) for k, v in items])

    def map_clear(self, prefix: bytes) -> None:
        self.flush_writes()
        start, read = self._map_range(prefix)
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key in self.db.keys(from_key=start, read_opt=read):
            batch.delete(key)
        if not batch.is_empty():
            self.db.write(batch, self._write_options)

    def delete_where(self, predicate: Callable[[bytes, bytes], bool]) -> int:
        """One pass over the database (map entries' keys start with their map's prefix,
        which is all a predicate over ``key_group | len | key | state_id`` reads)."""
        self.flush_writes()
        batch = rocksdict.WriteBatch(raw_mode=True)
        count = 0
        for key, value in self.db.items():
            if predicate(cast(bytes, key), cast(bytes, value)):
                batch.delete(key)
                count += 1
        if count:
            self.db.write(batch, self._write_options)
        return count

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, checkpoint_id: int) -> RocksDBSnapshot:
        """Flush the memtable and hard-link the live files: the only work the task waits for."""
        path = self.checkpoints_dir / f"chk-{checkpoint_id}-{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        self.flush_writes()
        rocksdict.Checkpoint(self._db).create_checkpoint(str(path))  # reads only: cache kept
        self.last_snapshot_pause = time.perf_counter() - started
        return RocksDBSnapshot(
            checkpoint_id, path, self._registry, self._local, self.options.upload_threads
        )

    def restore(self, handle: StateHandle, storage: CheckpointStorage) -> None:
        """Replace all state with ``handle``'s: fetch (or reuse locally) and verify every file."""
        if handle.backend != BACKEND_NAME:
            raise CheckpointError(
                f"the checkpoint was written by the {handle.backend!r} state backend, this task "
                f"uses {BACKEND_NAME!r}: switch back, or start the pipeline under a new name "
                "(moving state between backends needs savepoints, which Snapline lacks yet)"
            )
        checkpoint_id = int(handle.extra.get("checkpoint_id", -1))
        staging = self.task_dir / f"restore-{uuid.uuid4().hex[:8]}"
        started = time.perf_counter()
        try:
            result = fetch_files(
                storage,
                handle.files,
                staging,
                local_candidates=self._local_candidates(),
                threads=self.options.download_threads,
                progress=self.progress,
            )
            if not (staging / "CURRENT").exists():
                raise CorruptCheckpointError(
                    f"rocksdb checkpoint {handle.extra.get('manifest', '?')} has no CURRENT file"
                )
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.close()  # empties the read cache
        shutil.rmtree(self.db_dir, ignore_errors=True)
        staging.rename(self.db_dir)
        try:
            self._db = self._open()
        except Exception as exc:
            shutil.rmtree(self.db_dir, ignore_errors=True)
            self._db = self._open()
            raise CorruptCheckpointError(
                f"rocksdb could not open checkpoint {handle.extra.get('manifest', '?')} although "
                f"every file passed its checksum: {exc}"
            ) from exc
        shared = [f for f in handle.files if _is_sst(local_name(f.path))]
        if shared:
            location = storage.full_path(shared[0].path.rsplit("/", 1)[0])
            self._registry.reset(location, checkpoint_id, {local_name(f.path): f for f in shared})
        shutil.rmtree(self.previous_dir, ignore_errors=True)
        self.last_restore = result
        log.info(
            "restored checkpoint %d in %.2fs: %d files (%d bytes) downloaded, %d files "
            "(%d bytes) reused locally",
            checkpoint_id,
            time.perf_counter() - started,
            result.downloaded_files,
            result.downloaded_bytes,
            result.reused_files,
            result.reused_bytes,
        )

    def _local_candidates(self) -> dict[str, list[Path]]:
        """Local SST files by name: the live DB, kept checkpoints, an earlier incarnation's."""
        found: dict[str, list[Path]] = {}
        for root in (self.db_dir, self.checkpoints_dir, self.previous_dir):
            # os.walk ignores directories that vanish meanwhile (a checkpoint thread's release).
            for parent, _, names in os.walk(root):
                for name in names:
                    if _is_sst(name):
                        found.setdefault(name, []).append(Path(parent) / name)
        return found

    def put_many(self, entries: list[tuple[bytes, bytes]]) -> None:
        self.flush_writes()
        for start in range(0, len(entries), 50_000):
            batch = rocksdict.WriteBatch(raw_mode=True)
            for key, value in entries[start : start + 50_000]:
                batch.put(key, value)
            self.db.write(batch)

    exports_in_key_order = True

    def export_batches(self, rows: int) -> Iterator[tuple[pa.Array, pa.Array]]:
        """Batches in RocksDB's (bytewise, so key-group) order. Iterating holds the GIL; a
        batch at a time lets another thread's Parquet writing overlap it."""
        import pyarrow as pa

        from snapline.pipeline.state.columns import bulk

        read = rocksdict.ReadOptions()
        read.fill_cache(False)  # type: ignore[call-arg]
        entries = iter(self.db.items(read_opt=read))
        while True:
            with bulk():
                items = list(islice(entries, rows))
                if not items:
                    return
                keys = pa.array(list(map(itemgetter(0), items)), pa.binary())
                values = pa.array(list(map(itemgetter(1), items)), pa.binary())
                del items
            yield keys, values

    def export_arrays(self) -> tuple[pa.Array, pa.Array]:
        # Keys are stored in the layout export_arrays returns, in RocksDB's (bytewise) order.
        import pyarrow as pa

        for batch in self.export_batches(sys.maxsize):  # one batch: all of it
            return batch
        return pa.array([], pa.binary()), pa.array([], pa.binary())

    def load_arrays(self, stored: pa.Array, values: pa.Array) -> None:
        """Sorted into one SST file and ingested: no memtable, WAL or flush on the way."""
        import pyarrow.compute as pc

        from snapline.pipeline.state.columns import bulk

        if len(stored) == 0:
            return
        n = len(stored)
        later, earlier = stored.slice(1), stored.slice(0, n - 1)
        if n > 1 and pc.any(pc.less(later, earlier)).as_py():  # a savepoint's rows often are
            order = pc.sort_indices(stored)
            stored = stored.take(order)
            values = values.take(order)
            later, earlier = stored.slice(1), stored.slice(0, n - 1)
        if n > 1 and pc.any(pc.equal(later, earlier)).as_py():
            # A key twice: put_many semantics (the last one wins), which an SST cannot hold.
            super().load_arrays(stored, values)
            return
        with bulk():
            self._ingest_sorted(self.db, "restore", stored.to_pylist(), values.to_pylist())

    def items(self) -> Iterator[tuple[bytes, bytes | None, bytes]]:
        # Stored keys are key_group(2) | key_len(4) | key | state_id(1) [| MAP_TAG | user key].
        unpack = _KEY_LEN.unpack_from
        self.flush_writes()
        for stored, value in cast(Iterator[tuple[bytes, bytes]], self.db.items()):
            end = 7 + unpack(stored, 2)[0]
            if len(stored) > end and stored[end : end + 1] == _MAP_TAG:
                yield stored[:end], stored[end + 1 :], value
            else:
                yield stored, None, value

    def entry_count(self) -> int:
        """An estimate: RocksDB's ``estimate-num-keys`` plus the buffered puts minus the
        buffered deletes. Overwritten keys count more than once (in the buffer and the
        database, or in several files until a compaction), deleted ones may count still.

        Metrics sample this every second, so it reads the database without ``db``: that would
        write the buffer out and empty the read cache, which only a checkpoint should do."""
        count = self._db.property_int_value("rocksdb.estimate-num-keys")
        if count is None:
            return -1
        pending = self._pending
        deletes = list(pending.values()).count(None) if self._deleted else 0
        puts = len(pending) - deletes
        return max(0, int(count) + puts - deletes)


class _ClosedDB:
    """Stands in for the database after ``close``: any use is a clear error."""

    def __init__(self, task_dir: Path) -> None:
        self._task_dir = task_dir

    def __getattr__(self, name: str) -> Any:
        raise StateError(
            f"the rocksdb state backend in {self._task_dir} is closed; state is only available "
            "while its task runs"
        )
