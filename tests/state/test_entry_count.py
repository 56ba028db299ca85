"""``entry_count`` is sampled every second by the metrics: it must count without changing the
backend (no flush of rocksdb's write buffer, no emptied read cache, no settled memory columns)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from snapline.pipeline.keygroups import state_key_prefix
from snapline.pipeline.state.memory import MemoryStateBackend
from snapline.pipeline.state.rocksdb import SST_FLUSH_ENTRIES, RocksDBStateBackend


def _files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


def test_rocksdb_entry_count_keeps_the_write_buffer_and_the_read_cache(
    make_rocksdb: Callable[..., RocksDBStateBackend],
) -> None:
    backend = make_rocksdb()
    for i in range(2000):
        backend.put(b"old-%06d" % i, b"v")
    backend.flush_writes()  # in the database; what was written is the read cache now
    assert backend.get(b"old-000001") == b"v"
    new = SST_FLUSH_ENTRIES + 1000  # enough for a flush to ingest an SST file
    for i in range(new):
        backend.put(b"new-%06d" % i, b"w")
    for i in range(100):
        backend.delete(b"old-%06d" % i)
    pending, cache = backend._pending, backend._cache
    pending_before, cache_before = dict(pending), dict(cache)
    files_before = _files(backend.task_dir)

    count = backend.entry_count()

    assert backend._pending is pending and pending == pending_before
    assert backend._cache is cache and cache == cache_before
    assert backend._deleted
    assert _files(backend.task_dir) == files_before  # no SST file ingested
    assert 0.9 * (2000 + new - 100) <= count <= 1.1 * (2000 + new)


def test_rocksdb_entry_count_of_an_empty_and_a_flushed_backend(
    make_rocksdb: Callable[..., RocksDBStateBackend],
) -> None:
    backend = make_rocksdb()
    assert backend.entry_count() == 0
    for i in range(1000):
        backend.put(b"k-%06d" % i, b"v")
    buffered = backend.entry_count()
    backend.flush_writes()
    assert buffered == backend.entry_count() == 1000


def _stored(i: int) -> bytes:
    return state_key_prefix(i % 128, b"k%d" % i) + b"\x01"


def test_memory_entry_count_keeps_the_columns() -> None:
    backend = MemoryStateBackend()
    keys = sorted(_stored(i) for i in range(1000))
    backend.load_arrays(pa.array(keys), pa.array([b"v"] * len(keys)))
    map_prefix = state_key_prefix(3, b"m") + b"\x02"
    backend.map_put(map_prefix, b"a", b"1")
    backend.map_put(map_prefix, b"b", b"2")
    columns = backend._columns
    columns_before = list(columns)

    count = backend.entry_count()

    assert backend._columns is columns and columns == columns_before
    assert backend._values == {}
    assert backend._distinct
    assert count == 1002  # distinct columns and nothing in the dict: exact


def test_memory_entry_count_of_repeated_keys_is_an_upper_bound_until_settled() -> None:
    backend = MemoryStateBackend()
    keys = [_stored(i) for i in range(10)]
    backend.put(keys[0], b"in the dict")
    backend.load_arrays(pa.array(keys), pa.array([b"a"] * 10))
    backend.load_arrays(pa.array(keys[:5]), pa.array([b"b"] * 5))
    assert backend.entry_count() == 1 + 10 + 5
    assert len(backend._columns) == 2
    assert backend.get(keys[0]) == b"b"  # a single read settles the columns
    assert backend.entry_count() == 10
