"""The Parquet table sink: each checkpoint's rows are staged as hidden files, then published.

Exactly-once into a Hive-style partitioned directory that ``spark.read.parquet`` and pyarrow
read (DESIGN §6). Table layout::

    <table>/<col>=<value>/part-<job>-<task>-<checkpoint>-<token>-<seq>.parquet   published
    <table>/_staging/<job>/<sink>/<task>/<checkpoint>-<token>/...               pre-committed
    <table>/_commits/<job>/<sink>/<task>/<checkpoint>-<token>.json              commit log
    <table>/_commits/<job>/_job.json                       the job's Kafka cluster (identity.py)
    <table>/_schema.arrow                                                       table schema

``pre_commit(n)`` writes and fsyncs the epoch's files under ``_staging`` (readers skip paths
that start with ``_``); ``commit(n)`` writes the commit-log entry (the intent) and then renames
each staged file to its final, deterministic name, so re-running it is a no-op. ``token`` is
random per writer instance: a zombie's staged files can never be mistaken for the new owner's,
because commit and recovery publish exactly the files named in the committed metadata. Staged
files are deleted only when provably dead (``recover``): never on the strength of a checkpoint
id newer than the one this writer recovered, since a live owner may be about to commit it.

Threads: the task thread converts rows to Arrow record batches (dead-lettering rows that do not
fit the schema) and runs ``commit``/``abort``/``recover``. The background thread of the writer
(``staging.StagingSinkWriter``) writes the staged files of a pre-commit from batches that the
task thread handed over and never touches again (record batches are immutable).
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from snapline.pipeline.checkpoint.identity import IDENTITY_FILE, JobIdentity
from snapline.pipeline.checkpoint.storage import SETTING_ERRNOS, crc32_checksum
from snapline.pipeline.durable import fsync_path, makedirs_durable
from snapline.pipeline.errors import ConfigurationError, SinkError
from snapline.pipeline.record import Record
from snapline.pipeline.sink import Sink, SinkContext
from snapline.sinks.staging import StagingSinkWriter

__all__ = ["ParquetSink", "ParquetSinkWriter", "hive_partition_dir", "read_commit_log"]

log = logging.getLogger(__name__)

STAGING_DIR = "_staging"
COMMITS_DIR = "_commits"
SCHEMA_FILE = "_schema.arrow"
#: The schema file's metadata key holding its checksum (not part of the table's schema).
SCHEMA_CHECKSUM_KEY = b"snapline.checksum"
_SCHEMA_FIX = (
    "restore it from a backup, or delete it to have the next writer record its schema again "
    "(the schema the sink is given, or the one inferred from its first rows)"
)
HIVE_DEFAULT_PARTITION = "__HIVE_DEFAULT_PARTITION__"
DEFAULT_TARGET_FILE_SIZE = 128 * 1024 * 1024
#: Rows converted to Arrow at once; larger chunks amortise the conversion better.
CONVERT_CHUNK = 8192
COMPRESSIONS = ("zstd", "snappy", "gzip", "brotli", "lz4", "none")

_STAGED_NAME = re.compile(r"^(\d{10})-([0-9a-f]{12})$")
# Characters Hive (and so Spark) escape in partition directory names.
_HIVE_ESCAPE = frozenset("\"#%'*/:=?\\{[]^") | frozenset(chr(c) for c in range(0x20)) | {"\x7f"}
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


def _safe_name(text: str) -> str:
    """``text`` as a path component: kept if harmless, else sanitised plus a hash (no clash)."""
    if _SAFE_NAME.match(text) and len(text) <= 100:
        return text
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", text)[:80] or "x"
    return f"{cleaned}-{zlib.crc32(text.encode()):08x}"


def _partition_text(value: Any) -> str:
    if value is None or value == "":
        return HIVE_DEFAULT_PARTITION
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        return value.isoformat(sep=" ")
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def hive_partition_dir(columns: Sequence[str], values: Sequence[Any]) -> str:
    """The relative directory of one partition, e.g. ``day=2024-01-01/region=eu%2Fwest``.

    Escapes like Hive, which Spark and pyarrow (``partitioning="hive"``) unescape; a null or
    empty value becomes ``__HIVE_DEFAULT_PARTITION__``, which both read as null.
    """
    parts = []
    for column, value in zip(columns, values, strict=True):
        text = _partition_text(value)
        escaped = "".join(f"%{ord(c):02X}" if c in _HIVE_ESCAPE else c for c in text)
        parts.append(f"{column}={escaped}")
    return "/".join(parts)


# --------------------------------------------------------------------------- durability helpers


#: Module names the tests patch (a storage that fails on fsync).
_fsync_path = fsync_path
_makedirs_durable = makedirs_durable


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` durably, so a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent, directory=True)


# --------------------------------------------------------------------------- schema and rows

_PARTITION_TYPES = (
    pa.types.is_integer,
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_boolean,
    pa.types.is_date,
)


def _check_schema(
    schema: pa.Schema, partition_by: Sequence[str], checkpoint_column: str | None, where: str
) -> None:
    for column in partition_by:
        index = schema.get_field_index(column)
        if index < 0:
            raise ConfigurationError(
                f"ParquetSink partition column {column!r} is not in the {where} schema "
                f"{schema.names}; add it to the schema or fix partition_by"
            )
        if not any(check(schema.field(index).type) for check in _PARTITION_TYPES):
            raise ConfigurationError(
                f"ParquetSink partition column {column!r} has type {schema.field(index).type}; "
                "partition by an integer, string, boolean or date column"
            )
    if checkpoint_column is not None and checkpoint_column in schema.names:
        raise ConfigurationError(
            f"ParquetSink checkpoint_column {checkpoint_column!r} is also a column of the "
            f"{where} schema; the sink fills it, so remove it from the schema or rename it"
        )


def infer_schema(
    rows: Sequence[Any], partition_by: Sequence[str] = (), exclude: Sequence[str] = ()
) -> pa.Schema:
    """A schema for dict rows: every key seen, in first-seen order, with Arrow's inferred type.

    A column that is null in every row becomes a string column (give a schema to choose).
    """
    names: dict[str, None] = {}
    for row in rows:
        if isinstance(row, dict):
            names.update(dict.fromkeys(k for k in row if isinstance(k, str)))
    for column in partition_by:
        names.setdefault(column, None)
    fields = []
    for name in names:
        if name in exclude:
            continue
        values = [row.get(name) for row in rows if isinstance(row, dict)]
        try:
            arrow_type = pa.array(values).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            # Mixed types: the first value decides; rows that disagree become dead letters.
            first = next(v for v in values if v is not None)
            arrow_type = pa.array([first]).type
        if pa.types.is_null(arrow_type):
            log.warning(
                "ParquetSink: column %r is null in every row of the first batch; "
                "storing it as string (pass schema= to choose its type)",
                name,
            )
            arrow_type = pa.string()
        fields.append(pa.field(name, arrow_type))
    return pa.schema(fields)


def _fits_integer(values: list[Any]) -> bool:
    # pyarrow silently truncates 1.5 to 1 when converting to an integer type: refuse it.
    return not any(type(v) is float and not v.is_integer() for v in values)


#: The longest file or directory name (bytes) of the filesystems a table lives on (ext4,
#: xfs, btrfs, NFS): a partition's ``column=value`` directory must fit.
MAX_NAME_BYTES = 255
#: Partition values whose text is always short (a number, a flag, a day, a time).
_SHORT_TYPES = frozenset({int, float, bool, date, datetime})


def _long_partition(row: dict[str, Any], columns: Sequence[str]) -> str | None:
    """Why ``row``'s partition directory cannot be made, or None (per row: the usual short
    value is told apart by its length, a character escaping to at most 4 bytes)."""
    for column in columns:
        value = row.get(column)
        kind = type(value)
        if value is None or kind in _SHORT_TYPES:
            continue
        if kind is str and 4 * len(value) + len(column) < MAX_NAME_BYTES:
            continue
        name = hive_partition_dir([column], [value])
        size = len(name.encode())
        if size > MAX_NAME_BYTES:
            return (
                f"partition directory {name[:40]}... is {size} bytes (escaped), over the "
                f"{MAX_NAME_BYTES} a filesystem takes for a name; partition by a shorter "
                f"value than {column!r}"
            )
    return None


class RowConverter:
    """Turns dict rows into record batches of one schema; says why a row does not fit."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self._fields = list(schema)
        self._names = frozenset(schema.names)
        self._warned: set[str] = set()

    def convert(self, rows: Sequence[Any]) -> tuple[pa.RecordBatch | None, list[tuple[int, str]]]:
        """(batch of the rows that fit, [(index, reason)] of the rows that do not)."""
        rejected: list[tuple[int, str]] = []
        good = [i for i, row in enumerate(rows) if isinstance(row, dict)]
        if len(good) != len(rows):
            rejected = [
                (i, f"row is a {type(row).__name__}, a Parquet table needs a dict")
                for i, row in enumerate(rows)
                if not isinstance(row, dict)
            ]
            rows = [rows[i] for i in good]
        if not rows:
            return None, rejected
        names = self._names
        for row in rows:  # every row (about 5 % of the conversion): any of them may add a key
            if not names.issuperset(row):
                self._warn_extra(row)
        batch = self._fast(rows)
        if batch is not None:
            return batch, rejected
        fitted: list[dict[str, Any]] = []
        for position, row in enumerate(rows):
            result = self.fit_row(row)
            if isinstance(result, str):
                rejected.append((good[position], result))
            else:
                fitted.append(result)
        rejected.sort()
        if not fitted:
            return None, rejected
        batch = self._fast(fitted)
        if batch is None:
            raise SinkError(f"rows that fit {self.schema} one by one failed together; a bug")
        return batch, rejected

    def _fast(self, rows: Sequence[dict[str, Any]]) -> pa.RecordBatch | None:
        arrays = []
        for f in self._fields:
            values = [row.get(f.name) for row in rows]
            try:
                array = pa.array(values, type=f.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
                return None
            if pa.types.is_integer(f.type) and not _fits_integer(values):
                return None
            if not f.nullable and array.null_count:
                return None
            arrays.append(array)
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def fit_row(self, row: dict[str, Any]) -> dict[str, Any] | str:
        """The row with values cast to the schema's types, or why it cannot be."""
        out: dict[str, Any] = {}
        for f in self._fields:
            value = row.get(f.name)
            if value is None:
                if not f.nullable:
                    return f"missing required column {f.name!r} ({f.type})"
                out[f.name] = None
                continue
            try:
                pa.array([value], type=f.type)
                if pa.types.is_integer(f.type) and not _fits_integer([value]):
                    raise ValueError("fraction would be lost")
                out[f.name] = value
                continue
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
                pass
            try:
                out[f.name] = pa.array([value]).cast(f.type, safe=True)[0].as_py()
            except (
                pa.ArrowInvalid,
                pa.ArrowTypeError,
                pa.ArrowNotImplementedError,
                OverflowError,
                TypeError,
                ValueError,
            ) as exc:
                shown = repr(value)
                shown = shown if len(shown) <= 200 else shown[:200] + "..."
                return (
                    f"column {f.name!r}: {shown} ({type(value).__name__}) does not fit "
                    f"{f.type}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                )
        return out

    def _warn_extra(self, row: dict[str, Any]) -> None:
        extra = [k for k in row if k not in self._names and k not in self._warned]
        if extra:
            self._warned.update(extra)
            log.warning(
                "ParquetSink: columns %s are not in the table schema %s and are not "
                "written (pass schema= or delete _schema.arrow to change the schema)",
                extra,
                self.schema.names,
            )


def _schema_checksum(schema: pa.Schema) -> bytes:
    """CRC-32 of the columns (name, type, nullability) and the schema's metadata, written as
    text: not of the IPC bytes, which another pyarrow version may lay out differently."""
    fields = [[f.name, str(f.type), f.nullable] for f in schema]
    metadata = sorted([k.hex(), v.hex()] for k, v in (schema.metadata or {}).items())
    return crc32_checksum(orjson.dumps([fields, metadata])).encode()


def _checked_schema_bytes(schema: pa.Schema) -> bytes:
    """``schema`` as an Arrow IPC message whose metadata carries its checksum, so that a
    changed byte of ``_schema.arrow`` (a column renamed or retyped, whose values would then be
    written as nulls or refused) is detected at open."""
    metadata = {**(schema.metadata or {}), SCHEMA_CHECKSUM_KEY: _schema_checksum(schema)}
    return bytes(schema.with_metadata(metadata).serialize().to_pybytes())


def _read_table_schema(table: Path) -> pa.Schema | None:
    path = table / SCHEMA_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise SinkError(
            f"ParquetSink: {path} is not an Arrow schema ({exc}); {_SCHEMA_FIX}"
        ) from exc
    metadata = dict(schema.metadata or {})
    checksum = metadata.pop(SCHEMA_CHECKSUM_KEY, None)
    schema = schema.with_metadata(metadata) if metadata else schema.remove_metadata()
    if checksum is None:  # written before checksums
        return schema
    if _schema_checksum(schema) != checksum:
        raise SinkError(f"ParquetSink: {path} failed its checksum; {_SCHEMA_FIX}")
    return schema


def _store_table_schema(table: Path, schema: pa.Schema) -> tuple[pa.Schema, bool]:
    """Record ``schema`` as the table's unless one exists; return the table's schema and
    whether this call recorded it."""
    _makedirs_durable(table)
    final = table / SCHEMA_FILE
    tmp = table / f".{SCHEMA_FILE}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "wb") as handle:
        handle.write(_checked_schema_bytes(schema))
        handle.flush()
        os.fsync(handle.fileno())
    created = False
    try:
        os.link(tmp, final)  # atomic create: the first writer of a table decides its schema
        _fsync_path(table, directory=True)
        created = True
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    stored = _read_table_schema(table)
    assert stored is not None
    return stored, created


# --------------------------------------------------------------------------- staged checkpoints


@dataclass(frozen=True)
class StagedCheckpoint:
    """The files one writer staged for one checkpoint (paths relative to the table)."""

    checkpoint_id: int
    token: str
    files: tuple[str, ...]
    rows: int

    @property
    def name(self) -> str:
        return f"{self.checkpoint_id:010d}-{self.token}"

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint_id,
            "token": self.token,
            "files": list(self.files),
            "rows": self.rows,
        }

    @staticmethod
    def from_json(body: dict[str, Any]) -> StagedCheckpoint:
        return StagedCheckpoint(
            int(body["checkpoint"]),
            str(body["token"]),
            tuple(str(f) for f in body["files"]),
            int(body["rows"]),
        )


@dataclass(frozen=True)
class _StageJob:
    """Everything the background thread needs for one pre-commit; nothing in it changes."""

    checkpoint_id: int
    token: str
    file_prefix: str
    staged_dir: Path
    batches: tuple[pa.RecordBatch, ...]
    schema: pa.Schema
    partition_by: tuple[str, ...]
    checkpoint_column: str | None
    target_file_size: int
    compression: str


def _commit_entry_bytes(body: dict[str, Any]) -> bytes:
    """A commit-log entry: its fields plus ``checksum``, the CRC-32 of the other fields as
    sorted-key JSON (readers that ignore unknown keys read it as before)."""
    checksum = crc32_checksum(orjson.dumps(body, option=orjson.OPT_SORT_KEYS))
    return orjson.dumps({**body, "checksum": checksum}, option=orjson.OPT_INDENT_2)


def read_commit_entry(path: Path) -> dict[str, Any]:
    """A commit-log entry without its checksum; SinkError if it is not valid or fails its
    checksum (an entry written before checksums has none and is taken as it is). A changed
    byte in the file list would otherwise publish the wrong files and discard the others."""
    try:
        body = orjson.loads(path.read_bytes())
        checksum = body.pop("checksum", None)
    except (orjson.JSONDecodeError, AttributeError) as exc:
        raise SinkError(f"commit-log entry {path} is not valid: {exc!r}") from exc
    if checksum is not None and checksum != crc32_checksum(
        orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    ):
        raise SinkError(
            f"commit-log entry {path} failed its checksum ({checksum}): it is corrupt; restore "
            "it from a backup (it names the staged files of a committed checkpoint)"
        )
    return body


def read_commit_log(table: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every commit-log entry of a table (job, sink, task, checkpoint, files, rows), in order."""
    root = Path(table) / COMMITS_DIR
    entries = []
    for path in sorted(root.glob("*/*/*/*.json")):
        entries.append(read_commit_entry(path))
    entries.sort(key=lambda e: (e["job"], e["sink"], e["task"], e["checkpoint"]))
    return entries


# --------------------------------------------------------------------------- the sink


@dataclass(frozen=True, eq=False)
class ParquetSink(Sink):
    """Writes dict rows (``record.value``) exactly once into a partitioned Parquet table.

    ``path``: the table directory on a local or network filesystem (not an object store).
    ``partition_by``: columns that become ``<col>=<value>`` directories, in order.
    ``schema``: the Arrow schema of a row; by default the table's recorded schema, else one
    inferred from the first batch and recorded in ``_schema.arrow`` so every task writes the
    same. Rows that do not fit go to the dead-letter topic with the reason.
    ``target_file_size``: about this many bytes of (uncompressed) Arrow data per file.
    ``checkpoint_column``: if set, a column of that name holds the id of the checkpoint that
    committed the row.
    """

    path: str | os.PathLike[str]
    partition_by: Sequence[str] = ()
    schema: pa.Schema | None = None
    target_file_size: int = DEFAULT_TARGET_FILE_SIZE
    compression: str = "zstd"
    checkpoint_column: str | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.partition_by, str):
            object.__setattr__(self, "partition_by", (self.partition_by,))
        object.__setattr__(self, "partition_by", tuple(self.partition_by))
        if not self.name:
            object.__setattr__(self, "name", f"parquet:{os.fspath(self.path)}")
        self.validate()

    def validate(self) -> None:
        if not os.fspath(self.path):
            raise ConfigurationError("ParquetSink needs a table directory, got an empty path")
        if "://" in os.fspath(self.path):
            raise ConfigurationError(
                f"ParquetSink path {os.fspath(self.path)!r} is a URI; the sink publishes by "
                "atomic rename and needs a local or network filesystem path (docs/sinks.md "
                "explains object stores)"
            )
        if self.compression not in COMPRESSIONS:
            raise ConfigurationError(
                f"ParquetSink compression {self.compression!r} is unknown; use one of "
                f"{list(COMPRESSIONS)}"
            )
        if self.compression != "none" and not pa.Codec.is_available(self.compression):
            raise ConfigurationError(
                f"this pyarrow build lacks the {self.compression!r} codec; choose another"
            )
        if not isinstance(self.target_file_size, int) or self.target_file_size < 1024:
            raise ConfigurationError(
                f"ParquetSink target_file_size={self.target_file_size!r} must be an int of at "
                "least 1024 bytes"
            )
        for column in self.partition_by:
            if not isinstance(column, str) or not column or column[0] in "_.":
                raise ConfigurationError(
                    f"ParquetSink partition column {column!r} must be a name that does not "
                    "start with '_' or '.' (readers skip such directories)"
                )
        if len(set(self.partition_by)) != len(self.partition_by):
            raise ConfigurationError(f"ParquetSink partition_by {self.partition_by} repeats")
        if self.schema is not None:
            if not isinstance(self.schema, pa.Schema):
                raise ConfigurationError(
                    f"ParquetSink schema must be a pyarrow.Schema, got {type(self.schema)}"
                )
            _check_schema(self.schema, self.partition_by, self.checkpoint_column, "given")
            if len(self.partition_by) == len(self.schema):
                raise ConfigurationError(
                    "ParquetSink would partition by every column, leaving none in the files"
                )

    def open(self, context: SinkContext) -> ParquetSinkWriter:
        return ParquetSinkWriter(self, context)


class ParquetSinkWriter(StagingSinkWriter[_StageJob, StagedCheckpoint]):
    """One task's writer: buffers rows per epoch, stages them, publishes them on commit."""

    staged_noun = "files"

    def __init__(self, sink: ParquetSink, context: SinkContext) -> None:
        super().__init__(sink.name, f"parquet-sink-{_safe_name(context.task_id)}")
        self._sink = sink
        self._context = context
        self.table = Path(os.fspath(sink.path)).absolute()
        self.token = uuid.uuid4().hex[:12]
        job, task = _safe_name(context.job), _safe_name(context.task_id)
        # Two sinks of one job may share a table: each has its own staging and commit log.
        owner = Path(job, _safe_name(context.sink_name), task)
        self._file_prefix = f"part-{job}-{task}"
        self.staging_root = self.table / STAGING_DIR / owner
        self.commits_root = self.table / COMMITS_DIR / owner
        self._job, self._task = context.job, context.task_id
        try:
            _makedirs_durable(self.table)
            if not self.table.is_dir():
                raise NotADirectoryError(f"{self.table} is not a directory")
            if not os.access(self.table, os.W_OK | os.X_OK):
                raise PermissionError(f"no write permission on {self.table}")
        except OSError as exc:
            if exc.errno is not None and exc.errno not in SETTING_ERRNOS:  # EIO, a full disk
                raise SinkError(
                    f"{sink.name}: the Parquet table {self.table} cannot be created now ({exc})"
                ) from exc
            raise ConfigurationError(
                f"{sink.name}: the Parquet table {self.table} cannot be written ({exc}); give "
                "ParquetSink a directory this worker may create and write"
            ) from exc
        if context.cluster_id:
            self._check_identity(JobIdentity(context.job, context.cluster_id))
        self._converter: RowConverter | None = self._open_schema()
        # epoch -> record batches of rows already converted; epoch -> rows not yet converted
        self._batches: dict[int, list[pa.RecordBatch]] = {}
        self._unconverted: dict[int, tuple[list[Any], list[Record]]] = {}
        #: Staged checkpoints of other writers, newer than the one recovered: not provably
        #: dead yet (a live owner may commit them); swept once we commit a higher id.
        self._leftovers: set[str] = set()
        self.rows_staged = 0
        self.rows_dead_lettered = 0

    # ------------------------------------------------------------------ task thread: rows
    def write(self, record: Record, epoch: int) -> None:
        self.write_batch((record,), epoch)

    def write_batch(self, records: Sequence[Record], epoch: int) -> None:
        if not records:
            return
        values, kept = self._unconverted.setdefault(epoch, ([], []))
        values.extend(r.value for r in records)
        kept.extend(records)
        if len(values) >= CONVERT_CHUNK:
            self._convert(epoch)

    def _convert(self, epoch: int) -> None:
        entry = self._unconverted.pop(epoch, None)
        if entry is None:
            return
        values, records = entry
        if self._sink.partition_by:
            values, records = self._without_long_partitions(values, records, epoch)
            if not values:
                return
        converter = self._converter or self._first_converter(values)
        batch, rejected = converter.convert(values)
        for index, reason in rejected:
            self.rows_dead_lettered += 1
            self._context.dead_letter(records[index], f"{self._sink.name}: {reason}", epoch)
        if batch is not None and batch.num_rows:
            self._batches.setdefault(epoch, []).append(batch)

    def _without_long_partitions(
        self, values: list[Any], records: list[Record], epoch: int
    ) -> tuple[list[Any], list[Record]]:
        """The rows whose partition directories a filesystem can name: one longer than
        MAX_NAME_BYTES failed its checkpoint's staging (ENAMETOOLONG), every checkpoint
        after it, and every restart replayed the row (the job stopped on one bad row). Such a
        row is a dead letter naming the column."""
        columns = self._sink.partition_by
        keep_values: list[Any] = []
        keep_records: list[Record] = []
        for value, record in zip(values, records, strict=True):
            reason = _long_partition(value, columns) if isinstance(value, dict) else None
            if reason is None:
                keep_values.append(value)
                keep_records.append(record)
                continue
            self.rows_dead_lettered += 1
            self._context.dead_letter(record, f"{self._sink.name}: {reason}", epoch)
        return keep_values, keep_records

    def _check_identity(self, identity: JobIdentity) -> None:
        """The table's commit log of this job records the Kafka cluster it committed on."""
        path = self.table / COMMITS_DIR / _safe_name(identity.job) / IDENTITY_FILE
        if not path.exists():
            _makedirs_durable(path.parent)
            _write_atomic(path, identity.to_json())
        recorded = JobIdentity.from_json(path.read_bytes(), str(path))
        identity.check(recorded, f"{self._sink.name}: Parquet table {self.table}")

    def _open_schema(self) -> RowConverter | None:
        """The given schema (recorded for the table if it has none) or the table's, if any."""
        sink = self._sink
        stored = _read_table_schema(self.table)
        if sink.schema is not None:
            if stored is None:
                _store_table_schema(self.table, sink.schema)
            elif not stored.equals(sink.schema):
                log.warning(
                    "%s: the given schema differs from the table's recorded schema "
                    "%s; files of both will be in the table",
                    sink.name,
                    stored,
                )
            return RowConverter(sink.schema)
        if stored is None:
            return None
        _check_schema(
            stored,
            sink.partition_by,
            sink.checkpoint_column,
            f"table's recorded ({self.table / SCHEMA_FILE})",
        )
        return RowConverter(stored)

    def _first_converter(self, values: Sequence[Any]) -> RowConverter:
        """No schema yet: infer it from the first rows; the first task to record it wins."""
        sink = self._sink
        exclude = (sink.checkpoint_column,) if sink.checkpoint_column else ()
        schema = infer_schema(values, sink.partition_by, exclude)
        _check_schema(schema, sink.partition_by, sink.checkpoint_column, "inferred")
        schema, created = _store_table_schema(self.table, schema)
        # Every task infers a schema; only the one that recorded it says so (once per job).
        if created:
            log.info("%s: table schema %s", sink.name, schema)
        self._converter = RowConverter(schema)
        return self._converter

    # ------------------------------------------------------------------ two-phase commit
    def _take(self, checkpoint_id: int) -> _StageJob | None:
        """Epochs ≤ n as one staging job for the background thread (None: no rows)."""
        for epoch in sorted(e for e in self._unconverted if e <= checkpoint_id):
            self._convert(epoch)
        batches: list[pa.RecordBatch] = []
        for epoch in sorted(e for e in self._batches if e <= checkpoint_id):
            batches.extend(self._batches.pop(epoch))
        if not batches:
            return None
        assert self._converter is not None
        self.rows_staged += sum(b.num_rows for b in batches)
        return _StageJob(
            checkpoint_id=checkpoint_id,
            token=self.token,
            file_prefix=self._file_prefix,
            staged_dir=self.staging_root / f"{checkpoint_id:010d}-{self.token}",
            batches=tuple(batches),
            schema=self._converter.schema,
            partition_by=tuple(self._sink.partition_by),
            checkpoint_column=self._sink.checkpoint_column,
            target_file_size=self._sink.target_file_size,
            compression=self._sink.compression,
        )

    def _stage(self, job: _StageJob) -> StagedCheckpoint:
        """Background thread: write the job's rows as Parquet files under its staging
        directory, all fsynced. Reads nothing but the job."""
        try:
            return _stage_files(job)
        except SinkError:
            raise
        except Exception as exc:
            raise SinkError(
                f"could not stage checkpoint {job.checkpoint_id} under {job.staged_dir}: {exc}"
            ) from exc

    def commit(self, checkpoint_id: int) -> None:
        """Publish every staged checkpoint ≤ n by renaming its files into the table, then
        delete other writers' staged checkpoints that this commit proved dead."""
        super().commit(checkpoint_id)
        if self._leftovers:
            self._sweep_leftovers(checkpoint_id)

    def _discard(self, checkpoint_ids: Sequence[int], from_checkpoint: int) -> None:
        """Abort: delete this writer's staging directories of the aborted checkpoints."""
        for checkpoint_id in checkpoint_ids:
            shutil.rmtree(
                self.staging_root / f"{checkpoint_id:010d}-{self.token}", ignore_errors=True
            )

    def _drop_buffered(self, from_epoch: int | None = None) -> None:
        for buffered in (self._batches, self._unconverted):
            for epoch in [e for e in buffered if from_epoch is None or e >= from_epoch]:
                del buffered[epoch]

    def _recover_staged(self, committed: int | None, metadata: dict[str, Any] | None) -> None:
        """Publish what ``committed`` (or a commit-log intent) names; delete what is provably
        dead; leave staged checkpoints newer than ``committed`` alone.

        Only a staged checkpoint with an id ≤ ``committed`` that neither ``committed`` lists
        nor an intent names is dead: every committed checkpoint lists its writer's staged,
        unpublished ones, and recovery publishes those. A newer one may belong to a live
        owner about to commit it (this writer may be a zombie that read stale offsets), so
        it stays until a checkpoint with an id at least as high commits (``commit`` sweeps)."""
        listed: dict[str, StagedCheckpoint] = {}
        if metadata is not None and committed is not None:
            for body in metadata.get("pending", ()):
                staged = StagedCheckpoint.from_json(body)
                if staged.checkpoint_id <= committed:
                    listed[staged.name] = staged
        elif committed is not None:
            log.info(
                "%s: task %s recovers checkpoint %s without sink metadata; no staged "
                "files of it can be committed",
                self._sink.name,
                self._task,
                committed,
            )
        found: set[str] = set()
        for name in self._staged_names():
            intent = self._intent_path(name)
            if intent.exists():
                self._publish(StagedCheckpoint.from_json(read_commit_entry(intent)))
            elif name in listed:
                self._publish(listed[name])
            elif committed is not None and _staged_id(name) <= committed:
                self._discard_dead(name, committed)
            else:
                self._leftovers.add(name)
            found.add(name)
        for name, staged in listed.items():
            if name in found or self._intent_path(name).exists():
                # Published before: the commit-log entry comes before the first rename, and
                # the staged directory goes after the last. Its files may have moved on since
                # (a compaction of the table, a partition dropped by retention).
                continue
            if all((self.table / f).is_file() for f in staged.files):
                continue  # published before a version that wrote commit-log entries
            raise SinkError(
                f"{self._sink.name}: committed checkpoint {staged.checkpoint_id} of task "
                f"{self._task} names staged files under {self.staging_root / name} that are "
                "gone and were never published; were _staging directories deleted by hand?"
            )

    def _staged_names(self) -> list[str]:
        if not self.staging_root.is_dir():
            return []
        return sorted(d.name for d in self.staging_root.iterdir() if _staged_id(d.name) >= 0)

    def _discard_dead(self, name: str, committed: int) -> None:
        log.info(
            "%s: discarding staged %s of task %s (never committed: checkpoint %d committed "
            "without it)",
            self._sink.name,
            name,
            self._task,
            committed,
        )
        shutil.rmtree(self.staging_root / name, ignore_errors=True)

    def _sweep_leftovers(self, committed: int) -> None:
        """Staged checkpoints another writer left, now provably dead: ``committed`` (ours)
        passed their ids, and nothing committed them before it (see ``recover``)."""
        for name in sorted(self._leftovers):
            if _staged_id(name) > committed:
                continue
            self._leftovers.discard(name)
            intent = self._intent_path(name)
            if intent.exists():  # published by its own writer after our recovery looked
                self._publish(StagedCheckpoint.from_json(read_commit_entry(intent)))
            else:
                self._discard_dead(name, committed)

    # ------------------------------------------------------------------ helpers
    def _intent_path(self, name: str) -> Path:
        return self.commits_root / f"{name}.json"

    def _publish(self, staged: StagedCheckpoint) -> None:
        """Commit-log intent first, then one atomic rename per file. Idempotent."""
        intent = self._intent_path(staged.name)
        if not intent.exists():
            _makedirs_durable(self.commits_root)
            body = {
                "job": self._job,
                "sink": self._context.sink_name,
                "task": self._task,
                "committed_at": datetime.now(UTC).isoformat(),
                **staged.to_json(),
            }
            _write_atomic(intent, _commit_entry_bytes(body))
        staged_dir = self.staging_root / staged.name
        touched: set[Path] = set()
        for relative in staged.files:
            source, target = staged_dir / relative, self.table / relative
            if not target.parent.is_dir():
                _makedirs_durable(target.parent)
            try:
                os.rename(source, target)
            except FileNotFoundError:
                if target.exists():
                    continue  # published by an earlier (or a concurrent) run of this commit
                raise SinkError(
                    f"{self._sink.name}: staged file {source} of committed checkpoint "
                    f"{staged.checkpoint_id} is gone and {target} does not exist; were "
                    "_staging directories deleted by hand?"
                ) from None
            touched.add(target.parent)
        for directory in touched:
            _fsync_path(directory, directory=True)
        shutil.rmtree(staged_dir, ignore_errors=True)
        if touched:
            log.debug(
                "%s: published checkpoint %d of task %s (%d files, %d rows)",
                self._sink.name,
                staged.checkpoint_id,
                self._task,
                len(staged.files),
                staged.rows,
            )


# --------------------------------------------------------------------------- background thread


def _staged_id(name: str) -> int:
    """The checkpoint id of a staging directory ``<10-digit id>-<token>`` (-1: not one)."""
    head, _, token = name.partition("-")
    return int(head) if len(head) == 10 and head.isdigit() and token else -1


def _rows_per_file(table: pa.Table, target_file_size: int) -> int:
    if table.num_rows == 0:
        return 1
    bytes_per_row = max(1.0, table.nbytes / table.num_rows)
    return max(1, math.floor(target_file_size / bytes_per_row))


def _stage_files(job: _StageJob) -> StagedCheckpoint:
    if job.staged_dir.exists():  # a failed earlier attempt of this writer for the same id
        shutil.rmtree(job.staged_dir)
    _makedirs_durable(job.staged_dir)
    table = pa.Table.from_batches(job.batches, schema=job.schema)
    if job.checkpoint_column is not None:
        table = table.append_column(
            pa.field(job.checkpoint_column, pa.int64(), nullable=False),
            pa.repeat(pa.scalar(job.checkpoint_id, pa.int64()), table.num_rows),
        )
    groups: list[tuple[str, pa.Table]]
    if job.partition_by:
        indexed = table.append_column("__snapline_row", pa.array(range(table.num_rows), pa.int64()))
        grouped = (
            indexed.group_by(list(job.partition_by), use_threads=False)
            .aggregate([("__snapline_row", "list")])
            .to_pylist()
        )
        data = table.drop_columns(list(job.partition_by))
        groups = []
        for group in grouped:
            relative = hive_partition_dir(job.partition_by, [group[c] for c in job.partition_by])
            groups.append((relative, data.take(pa.array(group["__snapline_row_list"]))))
    else:
        groups = [("", table)]
    files: list[str] = []
    directories: set[Path] = {job.staged_dir}
    sequence = 0
    for relative_dir, part in groups:
        directory = job.staged_dir / relative_dir if relative_dir else job.staged_dir
        if directory not in directories:
            _makedirs_durable(directory)
            directories.add(directory)
        per_file = _rows_per_file(part, job.target_file_size)
        for offset in range(0, part.num_rows, per_file):
            name = f"{job.file_prefix}-{job.checkpoint_id:010d}-{job.token}-{sequence:05d}.parquet"
            sequence += 1
            path = directory / name
            pq.write_table(part.slice(offset, per_file), path, compression=job.compression)
            _fsync_path(path)
            files.append(f"{relative_dir}/{name}" if relative_dir else name)
    for directory in directories:
        _fsync_path(directory, directory=True)
    return StagedCheckpoint(job.checkpoint_id, job.token, tuple(files), table.num_rows)
