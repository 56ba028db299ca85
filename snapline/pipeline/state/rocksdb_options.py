"""Tuning of the rocksdb state backend: per-task options and the resources a worker shares.

A worker creates one ``RocksDBResources`` (block cache, optional write-buffer budget) and passes
it to every task's backend as ``shared_cache``, so memory is bounded per worker, not per task.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import rocksdict

from snapline.pipeline.errors import ConfigurationError

MiB = 1 << 20

_COMPRESSION = {
    "none": rocksdict.DBCompressionType.none,
    "lz4": rocksdict.DBCompressionType.lz4,
    "snappy": rocksdict.DBCompressionType.snappy,
    "zstd": rocksdict.DBCompressionType.zstd,
}


@dataclass(frozen=True)
class RocksDBOptions:
    """Per-task RocksDB settings with defaults sized for many tasks per worker.

    The defaults favour small checkpoint increments and short snapshot pauses: a modest write
    buffer (the synchronous part of a snapshot flushes it), small SST files and a small base
    level (a compaction rewrites, and the next checkpoint re-uploads, little), and dynamic level
    sizing (most data sits in the last level, rewritten rarely). Measured with
    ``python -m benchmarks.state_benchmark``; see docs/state-backends.md.
    """

    #: Block cache of this task when no shared cache is given.
    block_cache_bytes: int = 64 * MiB
    #: One memtable; the snapshot's synchronous part flushes at most this much (plus any
    #: full memtable still being flushed), so it bounds the pause.
    write_buffer_bytes: int = 8 * MiB
    max_write_buffers: int = 3
    #: SST file size; small files keep a compaction's output, hence an increment, small.
    target_file_bytes: int = 4 * MiB
    #: Size of the first level below L0; small, so merging L0 into it rewrites little.
    max_bytes_for_level_base: int = 16 * MiB
    #: L0 files (one per checkpoint flush) before they are merged down; fewer merges, fewer
    #: re-uploads, at the price of a few more files to look at per read (bloom filters help).
    level0_compaction_trigger: int = 8
    compression: str = "lz4"
    background_jobs: int = 2
    bloom_bits_per_key: int = 10
    block_bytes: int = 16 * 1024
    #: State is recovered from checkpoints, never from the WAL: writing it is wasted I/O.
    disable_wal: bool = True
    #: Threads per task that upload checkpoint files in the background. One leaves the other
    #: core to the task thread (the upload competes with processing while it runs).
    upload_threads: int = 1
    #: Threads per task that download checkpoint files on restore (the task waits anyway).
    download_threads: int = 4
    #: Hard-link copies of the newest local checkpoints kept for local recovery.
    local_checkpoints_kept: int = 1
    #: False for a scratch database that is read once or bulk-loaded (savepoint export and
    #: restore): a restored checkpoint's L0 files would otherwise start a compaction that
    #: competes with that work for the CPU and rewrites files about to be thrown away.
    auto_compactions: bool = True

    def __post_init__(self) -> None:
        if self.compression not in _COMPRESSION:
            raise ConfigurationError(
                f"rocksdb compression {self.compression!r} is unknown; use one of "
                f"{sorted(_COMPRESSION)}"
            )
        for name in (
            "block_cache_bytes",
            "write_buffer_bytes",
            "target_file_bytes",
            "max_bytes_for_level_base",
            "block_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"rocksdb option {name} must be positive")
        if self.max_write_buffers < 2:
            raise ConfigurationError(
                "rocksdb option max_write_buffers must be at least 2 "
                "(one memtable is flushed while the next one fills)"
            )
        if self.upload_threads < 1 or self.download_threads < 1:
            raise ConfigurationError(
                "rocksdb options upload_threads and download_threads must be >= 1"
            )
        if self.local_checkpoints_kept < 0:
            raise ConfigurationError("rocksdb option local_checkpoints_kept must be >= 0")

    @staticmethod
    def from_kwargs(kwargs: dict[str, Any]) -> RocksDBOptions:
        """Build from ``state_backend_options``; unknown names are an error that lists the known."""
        known = {f.name for f in fields(RocksDBOptions)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigurationError(
                f"unknown rocksdb state backend option(s) {unknown}; known: "
                f"{sorted(known | {'shared_cache'})}"
            )
        return RocksDBOptions(**kwargs)


class RocksDBResources:
    """Memory shared by the RocksDB instances of one worker: a block cache and a write budget.

    Create one per worker and pass it to each task's backend (``shared_cache=...``). Holding
    native handles, it is not a value object; it is never mutated after construction.
    """

    def __init__(
        self,
        block_cache_bytes: int = 256 * MiB,
        write_buffer_budget_bytes: int | None = None,
        *,
        cache: rocksdict.Cache | None = None,
    ) -> None:
        if block_cache_bytes <= 0:
            raise ConfigurationError("the shared block cache needs a positive size")
        self.block_cache_bytes = block_cache_bytes
        self.cache = cache if cache is not None else rocksdict.Cache(block_cache_bytes)
        self.write_buffer_manager = (
            None
            if write_buffer_budget_bytes is None
            else rocksdict.WriteBufferManager(write_buffer_budget_bytes, False)
        )


def build_db_options(options: RocksDBOptions, shared: RocksDBResources | None) -> rocksdict.Options:
    """The rocksdict ``Options`` of one task's database (raw byte keys and values)."""
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.set_write_buffer_size(options.write_buffer_bytes)
    opts.set_max_write_buffer_number(options.max_write_buffers)
    opts.set_target_file_size_base(options.target_file_bytes)
    opts.set_max_bytes_for_level_base(options.max_bytes_for_level_base)
    opts.set_level_compaction_dynamic_level_bytes(True)
    opts.set_level_zero_file_num_compaction_trigger(options.level0_compaction_trigger)
    opts.set_compression_type(_COMPRESSION[options.compression]())
    opts.set_max_background_jobs(options.background_jobs)
    opts.set_disable_auto_compactions(not options.auto_compactions)
    # RocksDB's info LOG gains ~9 KiB per checkpoint (one flush, one checkpoint): the one
    # series the 30-minute soak saw growing (to 26 MiB per worker with 8 MiB files). It rolls
    # at 1 MiB and two files are kept, so it levels off within minutes.
    opts.set_keep_log_file_num(2)
    opts.set_max_log_file_size(1 * MiB)
    # Every checkpoint uploads the MANIFEST; rolling it over keeps it (and increments) small.
    opts.set_max_manifest_file_size(2 * MiB)

    table = rocksdict.BlockBasedOptions()
    cache = shared.cache if shared is not None else rocksdict.Cache(options.block_cache_bytes)
    table.set_block_cache(cache)
    table.set_block_size(options.block_bytes)
    if options.bloom_bits_per_key > 0:
        table.set_bloom_filter(options.bloom_bits_per_key, False)
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    opts.set_block_based_table_factory(table)
    if shared is not None and shared.write_buffer_manager is not None:
        opts.set_write_buffer_manager(shared.write_buffer_manager)
    return opts
