"""The savepoint format: self-contained, portable, readable by pyarrow and Spark (DESIGN §5).

A savepoint directory holds, per stateful operator (by uid), one Parquet file per task it was
taken from — named by the task's key-group range in a keyed stage (``kg-00000-00031``), by its
partition in the source stage (``p3``) — with the columns of ``ENTRY_SCHEMA``; the records in
flight in each repartition topic (``in-flight/<name>.parquet``); and ``_savepoint.json``, written
last: pipeline, operators and their states (name, kind, serde), source offsets, repartition
topics, ``max_parallelism``, the Snapline version and a CRC-32 of every file. No pickle, no
reference to checkpoint files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from snapline.connectors.config import redact_text
from snapline.pipeline.checkpoint.storage import CheckpointStorage, crc32_checksum, verify_checksum
from snapline.pipeline.errors import CheckpointError, CorruptCheckpointError

FORMAT_VERSION = 1
#: Parquet codec of the data files. zstd wrote as fast as snappy in the savepoint benchmark
#: and 4x smaller files (less to write, checksum and read back); pyarrow and Spark read both.
COMPRESSION = "zstd"
METADATA_FILE = "_savepoint.json"

#: One row per stored state entry. ``key``: the key's bytes (str keys as UTF-8, others JSON);
#: ``key_text``: the same as text where it decodes; ``map_key``: a MapState entry's user key;
#: ``value_json``: the value as JSON text when the state's serde is JSON (Spark can parse it).
ENTRY_SCHEMA = pa.schema(
    [
        ("key_group", pa.int32()),
        ("key", pa.binary()),
        ("key_text", pa.string()),
        ("state", pa.string()),
        ("map_key", pa.binary()),
        ("map_key_text", pa.string()),
        ("value", pa.binary()),
        ("value_json", pa.string()),
    ]
)
#: A record's Kafka headers, in order (a name may repeat; a value may be null).
HEADERS_TYPE = pa.list_(pa.struct([("name", pa.string()), ("value", pa.binary())]))
#: Records of a repartition topic that upstream committed and downstream had not read yet.
#: ``headers``: the record's Kafka headers (the input's, which a later stage's dead letter
#: carries); null for a record without any. Files of earlier versions have no such column.
IN_FLIGHT_SCHEMA = pa.schema(
    [
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("timestamp", pa.int64()),
        ("headers", HEADERS_TYPE),
    ]
)


@dataclass(frozen=True)
class SavepointFile:
    """One data file, relative to the savepoint directory."""

    path: str
    rows: int
    size: int
    checksum: str
    #: Inclusive key-group range of a keyed-stage task's file; None in the source stage.
    key_groups: tuple[int, int] | None = None
    #: The task partition it was taken from.
    partition: int = -1

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "rows": self.rows,
            "size": self.size,
            "checksum": self.checksum,
            "key_groups": list(self.key_groups) if self.key_groups else None,
            "partition": self.partition,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> SavepointFile:
        groups = data.get("key_groups")
        return SavepointFile(
            data["path"],
            int(data["rows"]),
            int(data["size"]),
            data["checksum"],
            (int(groups[0]), int(groups[1])) if groups else None,
            int(data.get("partition", -1)),
        )


@dataclass(frozen=True)
class OperatorState:
    """The state of one stateful operator: its states' descriptions and its files."""

    uid: str
    #: "source" (state partitioned like the source topics) or "keyed" (by key-group ranges).
    partitioning: str
    states: list[dict[str, Any]]
    files: list[SavepointFile]

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": self.uid,
            "partitioning": self.partitioning,
            "states": self.states,
            "files": [f.to_json() for f in self.files],
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> OperatorState:
        return OperatorState(
            data["uid"],
            data["partitioning"],
            list(data["states"]),
            [SavepointFile.from_json(f) for f in data["files"]],
        )


@dataclass(frozen=True)
class InFlight:
    """A repartition topic's records between upstream's commit and downstream's position."""

    name: str
    topic: str
    partitions: int
    files: list[SavepointFile]


@dataclass(frozen=True)
class SavepointMetadata:
    pipeline: str
    snapline_version: str
    max_parallelism: int
    #: topic -> partition -> next offset to read
    source_offsets: dict[str, dict[int, int]]
    source_partitions: dict[str, int]
    operators: list[OperatorState]
    in_flight: list[InFlight]
    cluster_id: str = ""
    origin: str = "savepoint"
    created_at: float = field(default_factory=time.time)
    #: Each task's clock (watermarks) by task id, so a restore never moves event time back.
    clocks: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The highest checkpoint id the job had used when the savepoint was taken; a restore's
    #: ids go on above it, in whatever checkpoint storage it restores into (0: a savepoint of
    #: an earlier version, which did not record it).
    highest_checkpoint_id: int = 0
    #: The names of the ``key_by``s each stage reads, by its number when the savepoint was
    #: taken: a restore finds a stage's clocks by what it reads (code that adds a stage
    #: renumbers the ones after it). Empty in savepoints of earlier versions (the numbers are
    #: taken as they are).
    stage_reads: dict[int, list[str]] = field(default_factory=dict)
    #: Each source topic's id (Kafka gives a topic created again a new one) when the
    #: savepoint's offsets were read: a restore refuses offsets of a topic since recreated.
    #: Empty in savepoints of earlier versions and of topics without ids (not checked).
    source_topic_ids: dict[str, str] = field(default_factory=dict)
    #: The job's repartition topic generations when the savepoint was taken
    #: (``stages.repartition_topic``): a restore, also into another checkpoint storage, goes
    #: on from them and never uses a topic name the job had before. Empty in savepoints of
    #: earlier versions and of jobs whose topics were never replaced.
    topic_generations: dict[str, int] = field(default_factory=dict)

    def topic_ids_on(self, cluster_id: str) -> dict[str, str]:
        """The source topic ids to compare with the topics on cluster ``cluster_id``: none
        when the savepoint records another cluster (ids are per cluster: a job moved there
        keeps the savepoint's offsets); ids Kafka did not give are left out."""
        if self.cluster_id and cluster_id and self.cluster_id != cluster_id:
            return {}
        return {t: i for t, i in self.source_topic_ids.items() if i}

    def encode(self) -> bytes:
        body = {
            "format": FORMAT_VERSION,
            "pipeline": self.pipeline,
            "snapline_version": self.snapline_version,
            "max_parallelism": self.max_parallelism,
            "source_offsets": {
                t: {str(p): o for p, o in sorted(parts.items())}
                for t, parts in sorted(self.source_offsets.items())
            },
            "source_partitions": self.source_partitions,
            "operators": [op.to_json() for op in self.operators],
            "in_flight": [
                {
                    "name": f.name,
                    "topic": f.topic,
                    "partitions": f.partitions,
                    "files": [x.to_json() for x in f.files],
                }
                for f in self.in_flight
            ],
            "cluster_id": self.cluster_id,
            "origin": self.origin,
            "created_at": self.created_at,
            "clocks": self.clocks,
            "highest_checkpoint_id": self.highest_checkpoint_id,
            "stage_reads": {str(k): v for k, v in sorted(self.stage_reads.items())},
            "source_topic_ids": dict(sorted(self.source_topic_ids.items())),
            "topic_generations": dict(sorted(self.topic_generations.items())),
        }
        raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)
        return orjson.dumps(
            {"body": orjson.Fragment(raw), "checksum": crc32_checksum(raw)},
            option=orjson.OPT_INDENT_2,
        )

    @staticmethod
    def decode(data: bytes, what: str) -> SavepointMetadata:
        try:
            outer = orjson.loads(data)
            body = outer["body"]
            raw = orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2)
            checksum = outer["checksum"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{what} is not savepoint metadata: {exc}") from exc
        if crc32_checksum(raw) != checksum:
            raise CorruptCheckpointError(f"{what} failed its checksum ({checksum})")
        if body.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"{what} has format {body.get('format')}; this Snapline reads {FORMAT_VERSION}"
            )
        return SavepointMetadata(
            pipeline=body["pipeline"],
            snapline_version=body["snapline_version"],
            max_parallelism=int(body["max_parallelism"]),
            source_offsets={
                t: {int(p): int(o) for p, o in parts.items()}
                for t, parts in body["source_offsets"].items()
            },
            source_partitions={t: int(n) for t, n in body["source_partitions"].items()},
            operators=[OperatorState.from_json(op) for op in body["operators"]],
            in_flight=[
                InFlight(
                    f["name"],
                    f["topic"],
                    int(f["partitions"]),
                    [SavepointFile.from_json(x) for x in f["files"]],
                )
                for f in body["in_flight"]
            ],
            cluster_id=body.get("cluster_id", ""),
            origin=body.get("origin", "savepoint"),
            created_at=float(body.get("created_at", 0.0)),
            clocks=dict(body.get("clocks", {})),
            highest_checkpoint_id=int(body.get("highest_checkpoint_id", 0)),
            stage_reads={int(k): list(v) for k, v in body.get("stage_reads", {}).items()},
            source_topic_ids={str(t): str(i) for t, i in body.get("source_topic_ids", {}).items()},
            topic_generations={
                str(n): int(g) for n, g in body.get("topic_generations", {}).items()
            },
        )


#: Rows per Parquet row group: a restore reading a key-group range of a file (rows are in
#: key-group order) decodes only the row groups whose key-group statistics overlap it.
ROW_GROUP_ROWS = 65_536
#: Columns worth a dictionary: few distinct values. Keys and values are mostly unique, and a
#: dictionary attempt on them costs time for nothing.
DICTIONARY_COLUMNS = ["key_group", "state", "partition"]


class TableWriter:
    """A data file written a row group or a few at a time (as ``write_table`` would write the
    whole table), kept in memory until ``finish`` stores it with its size and CRC-32."""

    def __init__(self, schema: pa.Schema) -> None:
        self._sink = pa.BufferOutputStream()
        self._rows = 0
        self._writer = pq.ParquetWriter(
            self._sink,
            schema,
            compression=COMPRESSION,
            use_dictionary=[c for c in DICTIONARY_COLUMNS if c in schema.names],
            write_statistics=[c for c in ("key_group", "partition") if c in schema.names],
        )

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table, row_group_size=ROW_GROUP_ROWS)
        self._rows += table.num_rows

    def finish(self, storage: CheckpointStorage, path: str, **info: Any) -> SavepointFile:
        """Store the file at ``path`` (``storage`` is rooted at the savepoint); ``info``:
        key_groups / partition."""
        self._writer.close()
        data = memoryview(self._sink.getvalue())
        storage.write_bytes(path, data)
        return SavepointFile(path, self._rows, len(data), crc32_checksum(data), **info)


def write_table(
    storage: CheckpointStorage, path: str, table: pa.Table, **info: Any
) -> SavepointFile:
    """Write ``table`` as Parquet to ``path`` (``storage`` is rooted at the savepoint); the returned
    file entry has its size and CRC-32. ``info``: key_groups / partition."""
    writer = TableWriter(table.schema)
    writer.write(table)
    return writer.finish(storage, path, **info)


def read_table(
    storage: CheckpointStorage,
    entry: SavepointFile,
    *,
    columns: list[str] | None = None,
    key_groups: tuple[int, int] | None = None,
) -> pa.Table:
    """Read one data file (``storage`` is rooted at the savepoint), checksum verified first.
    ``columns``: only those; ``key_groups``: only the rows of that inclusive range."""
    data = storage.read_bytes(entry.path)
    verify_checksum(data, entry.checksum, f"savepoint file {storage.full_path(entry.path)}")
    if key_groups is None:
        return pq.read_table(pa.BufferReader(data), columns=columns)
    lo, hi = key_groups
    parquet = pq.ParquetFile(pa.BufferReader(data))
    meta = parquet.metadata
    index = parquet.schema_arrow.get_field_index("key_group")
    chosen = []
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(index).statistics
        if stats is None or not stats.has_min_max or (stats.min <= hi and stats.max >= lo):
            chosen.append(i)
    table = parquet.read_row_groups(chosen, columns=columns)
    groups = table.column("key_group").to_numpy()
    if len(groups) and not bool((groups[1:] >= groups[:-1]).all()):
        mask = pc.and_(
            pc.greater_equal(table.column("key_group"), lo),
            pc.less_equal(table.column("key_group"), hi),
        )
        return table.filter(mask)
    # Rows in key-group order (every savepoint Snapline writes): the range is one slice,
    # no copy of the values.
    start, stop = np.searchsorted(groups, [lo, hi + 1])
    return table.slice(int(start), int(stop - start))


def read_metadata(storage: CheckpointStorage) -> SavepointMetadata:
    """The metadata of the savepoint ``storage`` is rooted at."""
    if not storage.exists(METADATA_FILE):
        raise CheckpointError(
            f"{redact_text(storage.uri)} is not a complete savepoint (no {METADATA_FILE}); a "
            "savepoint "
            "without it was interrupted while being written, or the path is wrong"
        )
    return SavepointMetadata.decode(
        storage.read_bytes(METADATA_FILE), storage.full_path(METADATA_FILE)
    )
