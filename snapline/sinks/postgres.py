"""The PostgreSQL sink: exactly-once effect through staged rows and a checkpoint-fenced upsert.

``pre_commit(n)`` copies the epoch's rows (as JSON) into ``<table>__snapline_staging`` in one
transaction, so they are durable before the Kafka commit point. ``commit(n)`` runs ONE
transaction that upserts checkpoint n's staged rows into the table — the last row per key
within the checkpoint wins — and deletes them from staging. Every target row carries
``_snapline_checkpoint`` and ``_snapline_task``; the upsert only overwrites a row written by
the same task at a checkpoint ≤ n, so a replay never overwrites newer data. Re-running a commit
finds nothing staged: a no-op. Rows the database refuses at commit (a CHECK constraint, a
foreign key...) go, in the same transaction, to ``<table>__snapline_rejected``. Both ways of
applying (the bulk upsert, and row by row when a row is refused) lock the table's rows in key
order, so two tasks that write the same keys cannot deadlock each other; each of the sink's
transactions (the setup of its tables, a staging, an apply, a deletion of staged rows, the read
of the checkpoint ids a task applied) that PostgreSQL rolls back anyway (a deadlock with
someone else, a serialization failure) is run again, ``TRANSACTION_ATTEMPTS`` times at most,
before it is taken for an outage. The sink's session bounds its statements, lock waits and
transactions at ``SESSION_TIMEOUT`` (or the longer bound its role or DSN set: a short one
failed the same apply again at every restart), and checks that its client is still there
while a statement runs (``CLIENT_CONNECTION_CHECK_INTERVAL``). Its connections find a server
that is gone within about 40 s (TCP keepalives, a TCP user timeout), and the DSN it is given
is checked when it is built: ``postgres_connect``.

Threads: the task thread validates and encodes rows (dead-lettering those that do not fit the
table) and waits for commit/abort/recover. The background thread of the writer
(``staging.StagingSinkWriter``) owns the database connection and runs every statement in order:
the staging COPYs (whose futures ``pre_commit`` returns), the applies and the deletions. It
reads only immutable encoded rows, and sleeps there between attempts of a transaction.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import uuid
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time
from decimal import Decimal
from time import sleep
from typing import Any, TypeVar

import orjson
import psycopg
from psycopg import sql

from snapline.pipeline.checkpoint.identity import JobIdentity
from snapline.pipeline.errors import ConfigurationError, SinkError, SinkUnavailableError
from snapline.pipeline.record import Record
from snapline.pipeline.sink import Sink, SinkContext
from snapline.pipeline.state.serde import json_bytes
from snapline.sinks.postgres_connect import (
    REFUSED,
    check_dsn,
    connect_arguments,
    where,
)
from snapline.sinks.postgres_connect import without_secrets as _without_secrets
from snapline.sinks.staging import StagingSinkWriter

__all__ = ["ColumnSpec", "PostgresSink", "PostgresSinkWriter", "RowEncoder", "TableSpec"]

log = logging.getLogger(__name__)

CHECKPOINT_COLUMN = "_snapline_checkpoint"
TASK_COLUMN = "_snapline_task"
FENCE_COLUMNS = (CHECKPOINT_COLUMN, TASK_COLUMN)
STAGING_SUFFIX = "__snapline_staging"
REJECTED_SUFFIX = "__snapline_rejected"
JOBS_SUFFIX = "__snapline_jobs"
TASKS_SUFFIX = "__snapline_tasks"
#: PostgreSQL truncates identifiers to 63 bytes; longer derived names are shortened with a hash.
MAX_IDENTIFIER = 63
_COPY_CHUNK = 1 << 20
#: Seconds a writer's session may sit idle inside a transaction before PostgreSQL ends it
#: (``idle_in_transaction_session_timeout``, set unless the server or ``connect_kwargs`` set
#: one). A writer's transactions run their statements back to back, so only a frozen writer
#: (SIGSTOP, a paused VM) waits that long; its locks would otherwise hold the next owner's
#: recovery of the same task (and, inside the table's setup, every writer of the table) for
#: as long as it stays frozen.
IDLE_IN_TRANSACTION_TIMEOUT = 30
#: Session settings that end a statement, a lock wait or a transaction that lasts too long
#: (``transaction_timeout``: PostgreSQL 17). Each writer's session sets them to
#: ``SESSION_TIMEOUT``, or keeps the longer one the server, database, role or DSN set
#: (``PostgresSinkWriter._set_timeouts``).
SESSION_TIMEOUTS = ("statement_timeout", "lock_timeout", "transaction_timeout")
#: The server's side of each writer connection (in the settings' own units: s, s, probes,
#: ms), set where the server, role, database and DSN leave them at 0 (the kernel's): as the
#: client's side (``TCP_DEFAULTS``), a peer gone without a FIN is found in about 40 s.
#: Ignored by the server on a Unix-domain socket.
SERVER_TCP_DEFAULTS = {
    "tcp_keepalives_idle": "20",
    "tcp_keepalives_interval": "5",
    "tcp_keepalives_count": "4",
    "tcp_user_timeout": "40000",
}
#: Seconds a statement of the sink, its wait for a lock, or its transaction may last before
#: PostgreSQL ends it (an outage: exit 75, and the restart runs it again). Far above what a
#: healthy apply needs (33 000 rows/s at the least measured: 20 million rows of one task's
#: checkpoint), above the liveness watchdog's default (180 s: the watchdog, which prints where
#: the worker waited, ends a stuck worker first) and the longest ``checkpoint_timeout``
#: (600 s). Without a bound (0), a backend waiting for a lock stayed queued after its worker
#: was gone, holding a connection slot, one more at every restart; a role's or DSN's few
#: seconds canceled a large apply at every restart, without end. A longer bound set on the
#: role or in the DSN (``options=-c statement_timeout=2h``) is kept: the way to allow longer
#: applies.
SESSION_TIMEOUT = 600
#: Seconds between the checks that a running statement's client is still connected
#: (``client_connection_check_interval``, PostgreSQL 14, set unless the server, role or DSN
#: set one): a backend waiting for a lock does not read from its client, and stayed queued
#: after its worker had exited (the watchdog's exit 75) until ``SESSION_TIMEOUT``.
CLIENT_CONNECTION_CHECK_INTERVAL = 10
#: How many times one of the sink's transactions (each: the setup of its tables, a
#: checkpoint's staging, its apply, a deletion of staged rows, the read of the checkpoint ids
#: the task applied) is run when PostgreSQL rolls it back for a deadlock (40P01) or a
#: serialization failure (40001) (``_rolled_back``; the setup also when it lost a race to
#: create a table, ``_lost_a_catalog_race``) before the failure is taken for an outage
#: (``SinkUnavailableError``: the worker exits 75 and its restart runs it again).
TRANSACTION_ATTEMPTS = 5
#: Seconds between the first and the second attempt; the wait doubles after each attempt, up
#: to ``TRANSACTION_RETRY_MAX_DELAY``, and each wait is jittered
#: (``transaction_retry_delay``).
TRANSACTION_RETRY_DELAY = 0.1
TRANSACTION_RETRY_MAX_DELAY = 1.0
_INT_RANGES = {"int2": 2**15, "int4": 2**31, "int8": 2**63}
_T = TypeVar("_T")


class _Misfit(Exception):
    """A value that the column cannot take; the message is the dead-letter reason."""


#: What PostgreSQL raises for a row it refuses (the apply goes row by row, and the refused
#: rows are kept in the rejected table): a bad value (22), a constraint (23), a program limit
#: such as a key over the btree index row size (54, an OperationalError: it was taken for an
#: outage, and restarts re-applied the row without end), a trigger's RAISE (P0001).
_ROW_REFUSALS = (
    psycopg.errors.DataError,
    psycopg.errors.IntegrityError,
    psycopg.errors.ProgramLimitExceeded,
    psycopg.errors.RaiseException,
)
#: What PostgreSQL raises when it rolled a whole transaction back for its concurrency with
#: another one (the other goes on): a deadlock (40P01) or a serialization failure (40001).
#: Another attempt of the same transaction usually goes through
#: (``PostgresSinkWriter._run_transaction``).
_ROLLED_BACK = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)


def _rolled_back(exc: psycopg.Error) -> bool:
    """Whether PostgreSQL rolled ``exc``'s transaction back for its concurrency with another
    one (``_ROLLED_BACK``): worth another attempt of the whole transaction."""
    return isinstance(exc, _ROLLED_BACK)


def _lost_a_catalog_race(exc: psycopg.Error) -> bool:
    """Whether ``exc`` is a unique violation (23505) of one of PostgreSQL's catalogs
    (``pg_type_typname_nsp_index``, ``pg_class_relname_nsp_index``...): a ``CREATE TABLE IF
    NOT EXISTS`` (or ``CREATE INDEX``) of the setup met the same table created by a session
    that committed while it waited, which ``IF NOT EXISTS`` does not cover. The sink's own
    setups of a table never race (its advisory lock); another session's do (a migration
    creating the sink's tables), and failed the setup as a ``SinkError``, a crash (exit 1).
    The next attempt finds the table."""
    return isinstance(exc, psycopg.errors.UniqueViolation) and exc.diag.schema_name == "pg_catalog"


def _setup_may_retry(exc: psycopg.Error) -> bool:
    """What the setup of the sink's tables is run again for (``PostgresSinkWriter._setup``)."""
    return _rolled_back(exc) or _lost_a_catalog_race(exc)


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class ColumnSpec:
    """One column of the target table as the sink sees it."""

    name: str
    type_name: str  #: pg_type.typname of the column's (base) type, e.g. "int4", "varchar"
    display_type: str  #: format_type(), e.g. "character varying(20)"
    not_null: bool = False
    has_default: bool = False
    max_length: int | None = None  #: characters of varchar(n)/char(n)
    is_array: bool = False
    is_key: bool = False


@dataclass(frozen=True)
class TableSpec:
    """The target table, its staging and rejected tables, and the columns the sink writes."""

    schema: str
    table: str
    columns: tuple[ColumnSpec, ...]
    key_columns: tuple[str, ...]

    @property
    def target(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.table)

    @property
    def staging(self) -> sql.Identifier:
        return sql.Identifier(self.schema, derived_name(self.table, STAGING_SUFFIX))

    @property
    def rejected(self) -> sql.Identifier:
        return sql.Identifier(self.schema, derived_name(self.table, REJECTED_SUFFIX))

    @property
    def jobs(self) -> sql.Identifier:
        return sql.Identifier(self.schema, derived_name(self.table, JOBS_SUFFIX))

    @property
    def tasks(self) -> sql.Identifier:
        return sql.Identifier(self.schema, derived_name(self.table, TASKS_SUFFIX))

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)


def derived_name(table: str, suffix: str) -> str:
    """``<table><suffix>``, shortened with a hash of the table name if PostgreSQL would
    truncate it (two long table names must not share a staging table)."""
    name = table + suffix
    if len(name.encode()) <= MAX_IDENTIFIER:
        return name
    digest = f"{zlib.crc32(table.encode()):08x}"
    room = MAX_IDENTIFIER - len(suffix) - len(digest) - 1
    head = table.encode()[:room].decode("utf-8", "ignore")
    return f"{head}_{digest}{suffix}"


def split_table_name(table: str) -> tuple[str, str]:
    """``"schema.table"`` or ``"table"`` (schema ``public``) as (schema, table)."""
    parts = table.split(".")
    if len(parts) == 1 and parts[0]:
        return "public", parts[0]
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1]
    raise ConfigurationError(
        f"PostgresSink table {table!r} must be 'table' or 'schema.table' without quotes"
    )


def _staging_exists(connection: psycopg.Connection[Any], spec: TableSpec) -> bool:
    """Whether the staging table and its index exist. ``CREATE INDEX IF NOT EXISTS`` takes a
    ShareLock on the table before it looks: behind a writer frozen in its COPY (an active
    session, which no idle timeout ends) every task's setup, and every COPY after it, waited."""
    index = sql.Identifier(spec.schema, derived_name(spec.table, STAGING_SUFFIX + "_idx"))
    found = connection.execute(
        "SELECT to_regclass(%s)::oid, to_regclass(%s)::oid",
        (spec.staging.as_string(connection), index.as_string(connection)),
    ).fetchone()
    return found is not None and found[0] is not None and found[1] is not None


def staging_ddl(spec: TableSpec) -> list[sql.Composed]:
    """The staging table; indexed by (writer, checkpoint) only, which keeps COPY fast."""
    return [
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            "writer text NOT NULL, token text NOT NULL, checkpoint_id bigint NOT NULL, "
            "seq integer NOT NULL, row jsonb NOT NULL)"
        ).format(spec.staging),
        sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (writer, checkpoint_id)").format(
            sql.Identifier(derived_name(spec.table, STAGING_SUFFIX + "_idx")), spec.staging
        ),
    ]


def rejected_ddl(spec: TableSpec) -> sql.Composed:
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} ("
        "writer text NOT NULL, checkpoint_id bigint NOT NULL, seq integer NOT NULL, "
        "row jsonb NOT NULL, sqlstate text, error text NOT NULL, "
        "rejected_at timestamptz NOT NULL DEFAULT now())"
    ).format(spec.rejected)


def jobs_ddl(spec: TableSpec) -> sql.Composed:
    """Which Kafka cluster each job writing the table committed on (checkpoint/identity.py)."""
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (job text PRIMARY KEY, cluster_id text NOT NULL, "
        "first_seen timestamptz NOT NULL DEFAULT now())"
    ).format(spec.jobs)


def tasks_ddl(spec: TableSpec) -> sql.Composed:
    """The highest checkpoint id each task (``job/task``) applied to the table. The upsert
    keeps a row its task wrote at a higher id, so a job whose ids started again lower (its
    checkpoint storage wiped or replaced) would have its updates dropped, silently: the
    worker reads this at restore and takes its ids above it (``checkpoint_ids_above``)."""
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (task text PRIMARY KEY, checkpoint bigint NOT NULL)"
    ).format(spec.tasks)


def apply_sql(
    spec: TableSpec, single_row: bool = False, staging: sql.Composable | None = None
) -> sql.Composed:
    """Upsert one checkpoint's staged rows (last per key) into the target, fenced, in key order
    (the order in which the rows are locked; the row-by-row apply keeps it: ``key_order_sql``).

    Parameters: writer (staging key), token, checkpoint, task (the fence column's value), and
    seq when ``single_row``. ``staging``: the table to read the rows from (the staging table,
    or the row-by-row apply's temporary copy of one checkpoint's rows).
    """
    keys = [sql.Identifier(k) for k in spec.key_columns]
    cols = [sql.Identifier(c) for c in spec.column_names]
    r_cols = sql.SQL(", ").join(sql.SQL("r.{}").format(c) for c in cols)
    r_keys = sql.SQL(", ").join(sql.SQL("r.{}").format(k) for k in keys)
    updates = [
        sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c.name))
        for c in spec.columns
        if not c.is_key
    ]
    updates += [sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(c)) for c in FENCE_COLUMNS]
    row_filter = sql.SQL(" AND s.seq = %(seq)s") if single_row else sql.SQL("")
    return sql.SQL(
        "WITH src AS ("
        "SELECT DISTINCT ON ({r_keys}) {r_cols}, "
        "s.checkpoint_id AS __snapline_checkpoint "
        "FROM {staging} AS s CROSS JOIN LATERAL jsonb_populate_record(NULL::{target}, s.row) AS r "
        "WHERE s.writer = %(writer)s AND s.token = %(token)s "
        "AND s.checkpoint_id = %(checkpoint)s{row_filter} "
        "ORDER BY {r_keys}, s.seq DESC) "
        "INSERT INTO {target} AS t ({cols}, {chk}, {task}) "
        "SELECT {cols}, __snapline_checkpoint, %(task)s FROM src ORDER BY {keys} "
        "ON CONFLICT ({keys}) DO UPDATE SET {updates} "
        "WHERE t.{task} IS DISTINCT FROM EXCLUDED.{task} OR t.{chk} IS NULL "
        "OR t.{chk} <= EXCLUDED.{chk}"
    ).format(
        r_keys=r_keys,
        r_cols=r_cols,
        staging=spec.staging if staging is None else staging,
        target=spec.target,
        row_filter=row_filter,
        cols=sql.SQL(", ").join(cols),
        chk=sql.Identifier(CHECKPOINT_COLUMN),
        task=sql.Identifier(TASK_COLUMN),
        keys=sql.SQL(", ").join(keys),
        updates=sql.SQL(", ").join(updates),
    )


@dataclass(frozen=True)
class KeyOrderSql:
    """The statements that put a checkpoint's rows (copied into ``rows``) in the order in which
    ``apply_sql`` locks their keys, through a temporary table ``keys`` of their keys."""

    #: Creates ``keys`` (seq, key_0, key_1...), its key columns of the target's key columns'
    #: types and collations, so that they sort as ``apply_sql`` sorts.
    create: sql.Composed
    #: Fills ``keys`` with every row's key: the key columns only are read, so a bad value in
    #: another column does not fail it (a key PostgreSQL cannot read does).
    fill: sql.Composed
    #: Fills ``keys`` with the key of the row of seq %(seq)s, read as its apply reads it.
    fill_row: sql.Composed
    #: Every row's seq: by key, then by seq (a row without a key in ``keys`` last).
    ordered: sql.Composed


def key_order_sql(spec: TableSpec, rows: sql.Identifier, keys: sql.Identifier) -> KeyOrderSql:
    """``KeyOrderSql`` for the row-by-row apply of the rows in ``rows``."""
    names = [f"key_{i}" for i in range(len(spec.key_columns))]
    picked = sql.SQL(", ").join(
        sql.SQL("r.{} AS {}").format(sql.Identifier(k), sql.Identifier(n))
        for k, n in zip(spec.key_columns, names, strict=True)
    )
    key_json = sql.SQL("jsonb_build_object({})").format(
        sql.SQL(", ").join(
            sql.SQL("{0}::text, s.row -> {0}").format(sql.Literal(k)) for k in spec.key_columns
        )
    )
    select = sql.SQL(
        "SELECT s.seq, {picked} FROM {rows} AS s "
        "CROSS JOIN LATERAL jsonb_populate_record(NULL::{target}, {json}) AS r"
    )
    whole = select.format(picked=picked, rows=rows, target=spec.target, json=sql.SQL("s.row"))
    return KeyOrderSql(
        create=sql.SQL("CREATE TEMPORARY TABLE {} ON COMMIT DROP AS {} WITH NO DATA").format(
            keys, whole
        ),
        fill=sql.SQL("INSERT INTO {} ").format(keys)
        + select.format(picked=picked, rows=rows, target=spec.target, json=key_json),
        fill_row=sql.SQL("INSERT INTO {} {} WHERE s.seq = %(seq)s").format(keys, whole),
        ordered=sql.SQL(
            "SELECT s.seq FROM {} AS s LEFT JOIN {} AS k ON k.seq = s.seq ORDER BY {}, s.seq"
        ).format(
            rows,
            keys,
            sql.SQL(", ").join(sql.SQL("k.{}").format(sql.Identifier(n)) for n in names),
        ),
    )


def transaction_retry_delay(attempt: int, rng: random.Random) -> float:
    """Seconds to wait after the ``attempt``-th (1, 2...) attempt of one of the sink's
    transactions that PostgreSQL rolled back (``PostgresSinkWriter._run_transaction``):
    ``TRANSACTION_RETRY_DELAY`` doubled after each attempt, at most
    ``TRANSACTION_RETRY_MAX_DELAY``, times a random factor from 0.5 to 1, so that two writers
    that deadlocked do not meet in step."""
    delay = min(TRANSACTION_RETRY_MAX_DELAY, TRANSACTION_RETRY_DELAY * 2 ** (attempt - 1))
    return delay * rng.uniform(0.5, 1.0)


# --------------------------------------------------------------------------- row checks


def _check_int(limit: int) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise _Misfit(f"expects an integer, got {value[:100]!r}") from None
        if type(value) is bool or not isinstance(value, int):
            raise _Misfit(f"expects an integer, got {type(value).__name__}")
        if not -limit <= value < limit:
            raise _Misfit(f"{value} is out of range")
        return value

    return check


def _non_finite(value: float) -> str:
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _check_float(value: Any) -> Any:
    if isinstance(value, str):
        try:
            Decimal(value.strip())
        except ArithmeticError:
            raise _Misfit(f"expects a number, got {value[:100]!r}") from None
        return value
    if type(value) is bool or not isinstance(value, int | float | Decimal):
        raise _Misfit(f"expects a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        return _non_finite(value)  # JSON has no NaN; PostgreSQL parses these strings
    if isinstance(value, int) and abs(value) >= 2**63:
        return str(value)
    return value


def _check_bool(value: Any) -> Any:
    if type(value) is not bool:
        raise _Misfit(f"expects a boolean, got {type(value).__name__}")
    return value


def _check_text(max_length: int | None) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not isinstance(value, str):
            raise _Misfit(f"expects a string, got {type(value).__name__}")
        if max_length is not None and len(value) > max_length:
            raise _Misfit(f"is {len(value)} characters long, more than {max_length}")
        return value

    return check


def _check_parsed(
    kind: str, types: tuple[type, ...], parse: Callable[[str], Any], exclude: tuple[type, ...] = ()
) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if isinstance(value, types) and not isinstance(value, exclude):
            return value
        if isinstance(value, str):
            try:
                parse(value)
            except ValueError as exc:
                raise _Misfit(f"{value!r} is not a {kind}: {exc}") from None
            return value
        raise _Misfit(f"expects a {kind}, got {type(value).__name__}")

    return check


def _check_bytes(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return "\\x" + bytes(value).hex()
    raise _Misfit(f"expects bytes, got {type(value).__name__}")


def _check_array(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return list(value)
    raise _Misfit(f"expects a list, got {type(value).__name__}")


def _check_scalar(value: Any) -> Any:
    # Types the sink does not know (enums, intervals, inet...): PostgreSQL parses the text.
    if isinstance(value, str | int | float | bool | Decimal):
        return value
    raise _Misfit(f"expects a string or number, got {type(value).__name__}")


def _passthrough(value: Any) -> Any:
    return value


def _uuid(text: str) -> Any:
    return uuid.UUID(text)


def column_check(column: ColumnSpec) -> Callable[[Any], Any]:
    """The function that checks and normalises a value for ``column`` (raises ``_Misfit``)."""
    name = column.type_name
    if column.is_array:
        return _check_array
    if name in _INT_RANGES:
        return _check_int(_INT_RANGES[name])
    if name in ("float4", "float8", "numeric"):
        return _check_float
    if name == "bool":
        return _check_bool
    if name in ("text", "varchar", "bpchar", "name", "citext"):
        return _check_text(column.max_length)
    if name in ("json", "jsonb"):
        return _passthrough
    if name == "date":
        return _check_parsed("date", (date,), date.fromisoformat, exclude=(datetime,))
    if name in ("timestamp", "timestamptz"):
        return _check_parsed("timestamp", (datetime, date), datetime.fromisoformat)
    if name in ("time", "timetz"):
        return _check_parsed("time", (time,), time.fromisoformat)
    if name == "uuid":
        return _check_parsed("uuid", (uuid.UUID,), _uuid)
    if name == "bytea":
        return _check_bytes
    return _check_scalar


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return "\\x" + bytes(value).hex()
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class RowEncoder:
    """Checks a dict row against the table's columns and encodes it as a JSON object."""

    def __init__(self, columns: Sequence[ColumnSpec]) -> None:
        self._checks = [
            (
                c.name,
                column_check(c),
                c.is_key or (c.not_null and not c.has_default),
                c.is_key,
                c.display_type,
            )
            for c in columns
        ]
        self._names = frozenset(c.name for c in columns)

    def encode(self, row: Any) -> bytes | str:
        """The JSON bytes of the row, or the reason it does not fit."""
        if not isinstance(row, dict):
            return f"row is a {type(row).__name__}, a PostgreSQL table needs a dict"
        out: dict[str, Any] = {}
        for name, check, required, is_key, display in self._checks:
            value = row.get(name)
            if value is None:
                if required:
                    what = "key column" if is_key else "NOT NULL column"
                    return f"missing {what} {name!r} ({display})"
                out[name] = None
                continue
            try:
                out[name] = check(value)
            except _Misfit as exc:
                return f"column {name!r} ({display}) {exc}"
        try:
            data = json_bytes(out, default=_json_default)
        except (TypeError, orjson.JSONEncodeError) as exc:
            return f"cannot encode the row as JSON: {exc}"
        if b"\\u0000" in data:
            return "a value contains a NUL character, which PostgreSQL text cannot store"
        return data


def _copy_text(value: str) -> str:
    """``value`` escaped for COPY's text format."""
    return (
        value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    )


# --------------------------------------------------------------------------- the sink


@dataclass(frozen=True, eq=False)
class PostgresSink(Sink):
    """Upserts dict rows (``record.value``) into an existing PostgreSQL table, exactly once.

    ``table``: ``"table"`` or ``"schema.table"``; it must exist with a primary key or unique
    index on exactly ``key_columns``. The sink adds two columns if missing,
    ``_snapline_checkpoint bigint`` and ``_snapline_task text`` (the fence), and creates
    ``<table>__snapline_staging`` and ``<table>__snapline_rejected`` next to it.
    ``columns``: the columns a row sets (default: every column except the fence and generated
    ones); a column missing from a row is set to NULL.
    ``connect_kwargs``: passed to ``psycopg.connect`` (e.g. ``sslrootcert="/etc/ca.pem"``);
    not ``autocommit``, ``row_factory``, ``cursor_factory`` or ``context``: the sink's own.
    The DSN and ``connect_kwargs`` are checked when the sink is built (``ConfigurationError``).
    The sink's session sets ``statement_timeout``, ``lock_timeout`` and
    ``transaction_timeout`` to ``SESSION_TIMEOUT`` (10 minutes), unless the role, database or
    DSN set a longer one (``options="-c statement_timeout=2h"`` allows longer applies).
    """

    dsn: str = field(repr=False)  # may hold a password
    table: str
    key_columns: Sequence[str]
    columns: Sequence[str] | None = None
    name: str = ""
    connect_timeout: float = 10.0
    connect_kwargs: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.key_columns, str):
            object.__setattr__(self, "key_columns", (self.key_columns,))
        object.__setattr__(self, "key_columns", tuple(self.key_columns))
        if self.columns is not None:
            if isinstance(self.columns, str):
                object.__setattr__(self, "columns", (self.columns,))
            object.__setattr__(self, "columns", tuple(self.columns))
        if not self.name:
            object.__setattr__(self, "name", f"postgres:{self.table}")
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.dsn, str) or not self.dsn:
            raise ConfigurationError("PostgresSink needs a dsn, e.g. 'postgresql://host/db'")
        check_dsn(self)
        split_table_name(self.table)
        if not self.key_columns:
            raise ConfigurationError(
                f"PostgresSink for {self.table!r} needs key_columns: the table's primary key "
                "(the upsert and the checkpoint fence are per key)"
            )
        for column in (*self.key_columns, *(self.columns or ())):
            if not isinstance(column, str) or not column:
                raise ConfigurationError(f"PostgresSink column names must be strings: {column!r}")
            if column in FENCE_COLUMNS:
                raise ConfigurationError(
                    f"PostgresSink column {column!r} is the sink's own fence column; remove it"
                )
        if self.columns is not None:
            missing = [k for k in self.key_columns if k not in self.columns]
            if missing:
                raise ConfigurationError(
                    f"PostgresSink columns {list(self.columns)} lack the key columns {missing}"
                )

    def open(self, context: SinkContext) -> PostgresSinkWriter:
        return PostgresSinkWriter(self, context)


@dataclass(frozen=True)
class _StageRows:
    """One pre-commit's encoded rows, handed to the background thread; nothing in it changes."""

    checkpoint_id: int
    rows: tuple[bytes, ...]


@dataclass(frozen=True)
class StagedRows:
    """The rows one writer staged for one checkpoint, as listed in the checkpoint metadata."""

    checkpoint_id: int
    token: str
    rows: int

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint_id, "token": self.token, "rows": self.rows}


class PostgresSinkWriter(StagingSinkWriter[_StageRows, StagedRows]):
    """One task's writer: encodes rows per epoch, stages them, applies them on commit."""

    staged_noun = "rows"

    def __init__(self, sink: PostgresSink, context: SinkContext) -> None:
        super().__init__(sink.name, f"postgres-sink-{context.task_id}")
        self._sink = sink
        self._context = context
        #: Stored in the fence column: which task wrote a row.
        self.task_key = f"{context.job}/{context.task_id}"
        #: Keys staged rows; two sinks of one job may share a table and must not share staging.
        self.writer_key = f"{context.job}/{context.sink_name}/{context.task_id}"
        self.token = uuid.uuid4().hex[:12]
        self._epochs: dict[int, list[bytes]] = {}
        self._spec: TableSpec | None = None
        self._encoder: RowEncoder | None = None
        self._connection: psycopg.Connection[Any] | None = None  # background thread only
        self.rows_staged = 0
        self.rows_dead_lettered = 0
        self.rows_rejected = 0
        #: The highest checkpoint id this task applied, read at recovery (None: none).
        self._ids_above: int | None = None
        self._jitter = random.Random()  # background thread only: transaction_retry_delay

    # ------------------------------------------------------------------ task thread: rows
    def write(self, record: Record, epoch: int) -> None:
        self.write_batch((record,), epoch)

    def write_batch(self, records: Sequence[Record], epoch: int) -> None:
        if not records:
            return
        encode = (self._encoder or self._open()).encode
        rows = self._epochs.setdefault(epoch, [])
        for record in records:
            data = encode(record.value)
            if isinstance(data, bytes):
                rows.append(data)
            else:
                self.rows_dead_lettered += 1
                self._context.dead_letter(record, f"{self._sink.name}: {data}", epoch)

    def _open(self) -> RowEncoder:
        spec = self._call(self._setup)
        self._spec = spec
        self._encoder = RowEncoder(spec.columns)
        return self._encoder

    # ------------------------------------------------------------------ two-phase commit
    def _take(self, checkpoint_id: int) -> _StageRows | None:
        """Epochs ≤ n as one staging job (one transaction on the background thread)."""
        rows: list[bytes] = []
        for epoch in sorted(e for e in self._epochs if e <= checkpoint_id):
            rows.extend(self._epochs.pop(epoch))
        if not rows:
            return None
        self.rows_staged += len(rows)
        return _StageRows(checkpoint_id, tuple(rows))

    def _publish(self, staged: StagedRows) -> None:
        """Apply one staged checkpoint in its own transaction. Idempotent."""
        self._call(self._apply, staged.token, staged.checkpoint_id)

    def _discard(self, checkpoint_ids: Sequence[int], from_checkpoint: int) -> None:
        """Abort: delete this writer's staged rows of checkpoints ≥ n."""
        try:
            self._call(self._delete_staged, from_checkpoint)
        except SinkError as exc:
            # Staged rows no committed metadata names are never applied; recovery
            # deletes them. Nothing is lost by leaving them now.
            log.warning(
                "%s: could not delete aborted staged rows (recovery will): %s",
                self._sink.name,
                exc,
            )

    def _drop_buffered(self, from_epoch: int | None = None) -> None:
        for epoch in [e for e in self._epochs if from_epoch is None or e >= from_epoch]:
            del self._epochs[epoch]

    def _recover_staged(self, committed: int | None, metadata: dict[str, Any] | None) -> None:
        """Apply the staged checkpoints ``committed`` names; delete staged rows that are
        provably dead (checkpoint ids ≤ ``committed``); leave newer ones alone.

        Staged rows of a checkpoint newer than ``committed`` may belong to a live owner about
        to commit it (this writer may be a zombie that read stale offsets): they stay until
        this writer commits a checkpoint with an id at least as high (``_apply`` then deletes
        every other writer instance's rows up to that id)."""
        entries: list[tuple[int, str]] = []
        if metadata is not None and committed is not None:
            for body in metadata.get("pending", ()):
                if int(body["checkpoint"]) <= committed:
                    entries.append((int(body["checkpoint"]), str(body["token"])))
        if self._encoder is None:
            self._open()

        def run() -> int | None:
            for checkpoint_id, token in sorted(entries):
                self._apply(token, checkpoint_id)
            if committed is not None:
                self._delete_dead(committed)
            return self._applied_id()

        self._ids_above = self._call(run)

    def checkpoint_ids_above(self) -> int | None:
        return self._ids_above

    # ------------------------------------------------------------------ background thread
    def _where(self) -> str:
        return where(self._sink)

    def _fail(self, exc: BaseException, what: str, outage: bool = False) -> SinkError:
        """``exc`` as the sink's error: ``SinkUnavailableError`` (exit 75: restarts wait it
        out) where the connection failed or broke, or where ``outage`` says so (a transaction
        rolled back at every attempt), else ``SinkError``; no piece of the password in it."""
        unreachable = isinstance(exc, psycopg.OperationalError) or (
            self._connection is not None and self._connection.broken
        )
        if unreachable:
            self._disconnect()
        text = _without_secrets(str(exc).strip(), self._sink) or type(exc).__name__
        if getattr(exc, "sqlstate", None) in ("57014", "55P03", "25P04"):
            text += (
                f" (the sink's session ends a statement, a lock wait or a transaction after "
                f"{SESSION_TIMEOUT} s, or the longer bound its role or dsn set: look for a "
                "session that holds a lock on the table for that long; an apply that needs "
                "longer is allowed by options='-c statement_timeout=... -c lock_timeout=...' "
                "in the dsn)"
            )
        if unreachable and REFUSED.search(text):
            # Reached, and refused for the DSN's user, password or database: restarts (exit
            # 75, without end) would not fix it; a SinkError ends the worker (exit 1).
            return SinkError(
                f"{self._sink.name}: {self._where()} refused the connection: {text} (check "
                "the dsn's user, password, database and options, and the server's "
                "pg_hba.conf; staged rows are kept)"
            )
        return (SinkUnavailableError if unreachable or outage else SinkError)(
            f"{self._sink.name}: could not {what} {self._where()} table {self._sink.table!r}: "
            f"{text} (the checkpoint fails and is retried; staged rows are kept)"
        )

    def _conn(self) -> psycopg.Connection[Any]:
        """The writer's connection, opened if it has none (or a closed or broken one) with
        ``connect_arguments``: the sink's connect timeout, and TCP keepalives and a TCP user
        timeout (``TCP_DEFAULTS``) where the DSN and ``connect_kwargs`` set none, so that a
        statement to a server that is gone fails in about 40 s."""
        connection = self._connection
        if connection is None or connection.closed or connection.broken:
            kwargs = connect_arguments(self._sink, f"snapline:{self.task_key}")
            connection = psycopg.connect(self._sink.dsn, autocommit=True, **kwargs)
            try:
                self._prepare_session(connection)
            except BaseException:
                connection.close()  # else each failed attempt left a session on the server
                raise
            self._connection = connection
        return connection

    def _prepare_session(self, connection: psycopg.Connection[Any]) -> None:
        """The session settings every connection of the writer runs with."""
        self._set_timeouts(connection)
        # COPY writes UTF-8 bytes: on a database of another encoding (LATIN1) the session
        # kept it, and every non-ASCII value was stored garbled, a non-ASCII writer key
        # (the sink's name) matched no staged row, and the apply found nothing to apply.
        connection.execute("SET client_encoding = 'UTF8'")
        # Staged rows must be durable when pre_commit reports success.
        connection.execute("SET synchronous_commit = on")
        idle = connection.execute("SHOW idle_in_transaction_session_timeout").fetchone()
        if idle is not None and str(idle[0]).strip() in ("0", "0ms", "0s"):
            connection.execute(
                f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_TIMEOUT}s'"
            )
        # The server's end of the connection too: a writer's host that vanished (no FIN)
        # left its backend, idle between checkpoints, holding a connection slot for the
        # kernel's keepalive time (2 hours by default), one more at each replacement.
        unset = connection.execute(
            "SELECT name FROM pg_settings WHERE name = ANY(%s) AND reset_val = '0'",
            (list(SERVER_TCP_DEFAULTS),),
        ).fetchall()
        for (name,) in unset:
            connection.execute(
                "SELECT set_config(%s, %s, false)", (name, SERVER_TCP_DEFAULTS[name])
            )

    def _set_timeouts(self, connection: psycopg.Connection[Any]) -> None:
        """Bounds the session's ``SESSION_TIMEOUTS`` at ``SESSION_TIMEOUT``, or at the longer
        one the role, the database, the server or the DSN set (a shorter one is logged), and
        sets ``client_connection_check_interval`` where the server has it and none is set.

        A per-statement limit meant for interactive sessions (a few seconds) canceled an apply
        that outlasted it (57014, 55P03: an OperationalError, taken for a database down), and
        every restart applied the same checkpoint again and failed the same way, without end
        (exit 75). No limit at all (0) left a backend waiting for a lock (someone's ALTER
        TABLE, an idle transaction) queued for as long as the lock was held, its worker long
        gone: a backend that waits for a lock does not notice that its client closed the
        connection, unless it checks (``CLIENT_CONNECTION_CHECK_INTERVAL``)."""
        bound = SESSION_TIMEOUT * 1000  # milliseconds, the unit of the three settings
        # On its own, first: until it has run, each statement (this one too, which takes
        # microseconds) runs under the role's or the DSN's statement_timeout.
        connection.execute(f"SET statement_timeout = {bound}")
        settings = connection.execute(
            "SELECT name, reset_val, unit, "
            "set_config(name, GREATEST(reset_val::bigint, %s)::text, false) "
            "FROM pg_settings WHERE name = ANY(%s) AND unit = 'ms'",
            (bound, list(SESSION_TIMEOUTS)),
        ).fetchall()
        raised = [
            (name, value, unit) for name, value, unit, _ in settings if 0 < int(value) < bound
        ]
        if raised:
            log.info(
                "%s: bounding the sink's own statements at %d s, not by %s (an apply that "
                "outlasted it failed again at every restart; a longer bound set in the dsn's "
                "options or on the role is kept)",
                self._sink.name,
                SESSION_TIMEOUT,
                ", ".join(f"{name} = {value}{unit or ''}" for name, value, unit in raised),
            )
        check = connection.execute(
            "SELECT reset_val FROM pg_settings WHERE name = 'client_connection_check_interval'"
        ).fetchone()
        if check is not None and str(check[0]) == "0":
            try:
                connection.execute(
                    "SELECT set_config('client_connection_check_interval', %s, false)",
                    (f"{CLIENT_CONNECTION_CHECK_INTERVAL}s",),
                )
            except psycopg.errors.InvalidParameterValue as exc:
                # A server on a platform whose kernel cannot report a closed socket (Windows)
                # takes only 0: an orphaned backend then ends at SESSION_TIMEOUT.
                log.info(
                    "%s: the server does not check that a statement's client is connected: %s",
                    self._sink.name,
                    (str(exc).strip().splitlines() or [""])[0],
                )

    def _close_background(self) -> None:
        self._disconnect()

    def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.close()

    def _setup(self) -> TableSpec:
        """Connect, then set the table up (``_setup_table``), again if PostgreSQL rolled the
        setup's transaction back or it lost a race to create one of the sink's tables
        (``_run_transaction``). A deadlock there (with a session that holds a lock on the
        table and waits for one the setup holds) failed the worker's first write or its
        recovery as an outage (exit 75); losing the race, as a crash (exit 1).

        Running it again is safe: it is one transaction, which PostgreSQL rolled back whole
        (the fence columns, the tables it created, its advisory lock), and each of its steps
        looks at what exists before it creates or fills anything."""
        try:
            self._conn()
        except psycopg.Error as exc:
            raise self._fail(exc, "connect to") from exc
        return self._run_transaction(
            self._setup_table,
            "the setup of the sink's tables",
            "set up the sink's tables",
            "for",
            retry=_setup_may_retry,
        )

    def _setup_table(self) -> TableSpec:
        """ONE transaction: under the table's advisory lock (the setups of one table, by any
        task or job, run one at a time), check the table, add the fence columns and create
        the sink's tables that are missing. Returns the table as the sink writes it."""
        sink = self._sink
        schema, table = split_table_name(sink.table)
        connection = self._conn()
        with connection.transaction():
            qualified = sql.Identifier(schema, table).as_string(connection)
            oid = connection.execute("SELECT to_regclass(%s)::oid", (qualified,)).fetchone()
            if oid is None or oid[0] is None:
                keys = ", ".join(f"{k} ... " for k in sink.key_columns)
                raise ConfigurationError(
                    f"{sink.name}: table {qualified} does not exist in {self._where()}; create "
                    f"it first, e.g. CREATE TABLE {qualified} ({keys}PRIMARY KEY "
                    f"({', '.join(sink.key_columns)}))"
                )
            relid = oid[0]
            connection.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))", (f"snapline-sink:{qualified}",)
            )
            columns = _read_columns(connection, relid)
            self._check_key_index(connection, relid, qualified)
            present = {c.name: c for c in columns}
            fence = []
            if CHECKPOINT_COLUMN not in present:
                fence.append(
                    sql.SQL("ADD COLUMN IF NOT EXISTS {} bigint").format(
                        sql.Identifier(CHECKPOINT_COLUMN)
                    )
                )
            if TASK_COLUMN not in present:
                fence.append(
                    sql.SQL("ADD COLUMN IF NOT EXISTS {} text").format(sql.Identifier(TASK_COLUMN))
                )
            if fence:
                connection.execute(
                    sql.SQL("ALTER TABLE {} ").format(sql.Identifier(schema, table))
                    + sql.SQL(", ").join(fence)
                )
            else:
                _check_fence_types(present, qualified)
            spec = self._spec_from(schema, table, columns, qualified)
            if not _staging_exists(connection, spec):
                for statement in staging_ddl(spec):
                    connection.execute(statement)
            self._create_tasks_table(connection, spec, upgrade=not fence)
            connection.execute(rejected_ddl(spec))
            if self._context.cluster_id:
                self._check_identity(connection, spec, qualified)
        return spec

    def _create_tasks_table(
        self, connection: psycopg.Connection[Any], spec: TableSpec, upgrade: bool
    ) -> None:
        """``tasks_ddl``; a table an earlier version wrote (``upgrade``: it has the fence
        columns) fills it from its rows, once (a scan of the table, under the setup lock)."""
        qualified = spec.tasks.as_string(connection)
        exists = connection.execute("SELECT to_regclass(%s)::oid", (qualified,)).fetchone()
        if exists is not None and exists[0] is not None:
            return
        connection.execute(tasks_ddl(spec))
        if upgrade:
            connection.execute(
                sql.SQL(
                    "INSERT INTO {} (task, checkpoint) SELECT {task}, max({chk}) FROM {} "
                    "WHERE {task} IS NOT NULL AND {chk} IS NOT NULL GROUP BY {task}"
                ).format(
                    spec.tasks,
                    spec.target,
                    task=sql.Identifier(TASK_COLUMN),
                    chk=sql.Identifier(CHECKPOINT_COLUMN),
                )
            )

    def _check_identity(
        self, connection: psycopg.Connection[Any], spec: TableSpec, qualified: str
    ) -> None:
        identity = JobIdentity(self._context.job, self._context.cluster_id)
        connection.execute(jobs_ddl(spec))
        connection.execute(
            sql.SQL(
                "INSERT INTO {} (job, cluster_id) VALUES (%s, %s) ON CONFLICT DO NOTHING"
            ).format(spec.jobs),
            (identity.job, identity.cluster_id),
        )
        row = connection.execute(
            sql.SQL("SELECT cluster_id FROM {} WHERE job = %s").format(spec.jobs), (identity.job,)
        ).fetchone()
        assert row is not None
        identity.check(
            JobIdentity(identity.job, row[0]),
            f"{self._sink.name}: PostgreSQL table {qualified} ({spec.jobs.as_string(connection)})",
        )

    def _check_key_index(
        self, connection: psycopg.Connection[Any], relid: int, qualified: str
    ) -> None:
        keys = set(self._sink.key_columns)
        rows = connection.execute(
            "SELECT array(SELECT a.attname::text FROM unnest(i.indkey) AS k "
            "JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k) "
            "FROM pg_index i WHERE i.indrelid = %s AND i.indisunique "
            "AND i.indpred IS NULL AND i.indexprs IS NULL",
            (relid,),
        ).fetchall()
        if not any(set(r[0]) == keys for r in rows):
            columns = ", ".join(self._sink.key_columns)
            raise ConfigurationError(
                f"{self._sink.name}: {qualified} has no primary key or unique index on exactly "
                f"({columns}); the upsert needs one: ALTER TABLE {qualified} ADD PRIMARY KEY "
                f"({columns})"
            )

    def _spec_from(
        self, schema: str, table: str, columns: list[_Column], qualified: str
    ) -> TableSpec:
        sink = self._sink
        by_name = {c.name: c for c in columns}
        wanted = (
            list(sink.columns)
            if sink.columns is not None
            else [c.name for c in columns if c.name not in FENCE_COLUMNS and not c.generated]
        )
        missing = [c for c in (*sink.key_columns, *wanted) if c not in by_name]
        if missing:
            raise ConfigurationError(
                f"{sink.name}: {qualified} has no columns {missing}; its columns are "
                f"{[c.name for c in columns]}"
            )
        generated = [c for c in wanted if by_name[c].generated]
        if generated:
            raise ConfigurationError(
                f"{sink.name}: columns {generated} of {qualified} are generated and cannot be "
                "written; leave them out of columns="
            )
        specs = tuple(by_name[c].spec(is_key=c in sink.key_columns) for c in wanted)
        return TableSpec(schema, table, specs, tuple(sink.key_columns))

    def _stage(self, job: _StageRows) -> StagedRows:
        """COPY the rows into staging and commit: durable before the Kafka commit. Run again
        if PostgreSQL rolled the transaction back (``_run_transaction``): safe, for nothing
        of the attempt remains (the transaction is the deletion of an earlier attempt's rows
        and the COPY, rolled back whole), and the next one stages the same immutable rows
        under the same writer, token and checkpoint, deleting any staged before."""
        checkpoint_id = job.checkpoint_id
        self._run_transaction(
            lambda: self._stage_once(job),
            f"the staging of checkpoint {checkpoint_id}",
            f"stage checkpoint {checkpoint_id}",
            "into",
        )
        return StagedRows(checkpoint_id, self.token, len(job.rows))

    def _stage_once(self, job: _StageRows) -> None:
        """ONE transaction: delete what an earlier attempt of this writer staged for the
        checkpoint, then COPY its rows (``job``: immutable, the same at every attempt)."""
        spec = self._spec
        assert spec is not None
        checkpoint_id, rows = job.checkpoint_id, job.rows
        connection = self._conn()
        prefix = f"{_copy_text(self.writer_key)}\t{self.token}\t{checkpoint_id}\t".encode()
        with connection.transaction(), connection.cursor() as cursor:
            # A failed earlier attempt of this writer for the same id must not add rows.
            cursor.execute(
                sql.SQL(
                    "DELETE FROM {} WHERE writer = %s AND checkpoint_id = %s AND token = %s"
                ).format(spec.staging),
                (self.writer_key, checkpoint_id, self.token),
            )
            copy_sql = sql.SQL(
                "COPY {} (writer, token, checkpoint_id, seq, row) FROM STDIN"
            ).format(spec.staging)
            with cursor.copy(copy_sql) as copy:
                chunk: list[bytes] = []
                size = 0
                for seq, data in enumerate(rows):
                    line = b"%s%d\t%s\n" % (prefix, seq, data.replace(b"\\", b"\\\\"))
                    chunk.append(line)
                    size += len(line)
                    if size >= _COPY_CHUNK:
                        copy.write(b"".join(chunk))
                        chunk, size = [], 0
                if chunk:
                    copy.write(b"".join(chunk))

    def _run_transaction(
        self,
        attempt_once: Callable[[], _T],
        step: str,
        action: str,
        preposition: str,
        retry: Callable[[psycopg.Error], bool] = _rolled_back,
    ) -> _T:
        """``attempt_once()``, ONE transaction of the sink, run again if PostgreSQL rolled it
        back for a deadlock or a serialization failure (``retry``: ``_rolled_back``): at most
        ``TRANSACTION_ATTEMPTS`` times, after a short jittered wait each
        (``transaction_retry_delay``), before it fails as an outage would
        (``SinkUnavailableError``; the worker's restart runs it again). ``step`` names it in
        the log ("the apply of checkpoint 3"), ``action`` and ``preposition`` in the failure
        ("could not commit checkpoint 3 into ...").

        Only for a function that runs one whole transaction (``connection.transaction()`` on
        the autocommit session) and can be run again: 40P01 and 40001 abort the transaction,
        not the statement, so a retried statement would run without what came before it in
        its transaction. Each caller says why running it again is safe."""
        attempt = 1
        while True:
            try:
                return attempt_once()
            except psycopg.Error as exc:
                if not retry(exc):
                    raise self._fail(exc, f"{action} {preposition}") from exc
                if attempt == TRANSACTION_ATTEMPTS:
                    what = f"{action} ({attempt} attempts) {preposition}"
                    raise self._fail(exc, what, outage=True) from exc
                delay = transaction_retry_delay(attempt, self._jitter)
                log.warning(
                    "%s: PostgreSQL rolled back %s (%s: %s); attempt %d of %d in %.2f s",
                    self._sink.name,
                    step,
                    exc.sqlstate,
                    (str(exc).strip().splitlines() or [""])[0],
                    attempt + 1,
                    TRANSACTION_ATTEMPTS,
                    delay,
                )
                sleep(delay)
                attempt += 1

    def _apply(self, token: str, checkpoint_id: int) -> None:
        """Apply one staged checkpoint (``_apply_once``), again if PostgreSQL rolled its
        transaction back (``_run_transaction``).

        Running it again is safe: PostgreSQL ended the whole transaction (40P01 and 40001
        abort the transaction, not the statement; raised inside a savepoint, they leave the
        outer ``transaction()`` block too, which rolls back), so none of the attempt's upserts,
        rejected rows, tasks row or staging deletion happened, its advisory lock is released
        and its temporary tables (created in it) are gone; the staged rows are all still
        there, and the next attempt reads the same ones. Its refused rows are counted only
        once the transaction committed. And an apply is idempotent anyway: one that committed
        deleted its staged rows, so running it again is a no-op."""
        self.rows_rejected += self._run_transaction(
            lambda: self._apply_once(token, checkpoint_id),
            f"the apply of checkpoint {checkpoint_id}",
            f"commit checkpoint {checkpoint_id}",
            "into",
        )

    def _apply_once(self, token: str, checkpoint_id: int) -> int:
        """ONE transaction: upsert the checkpoint's staged rows, fenced, and delete them.
        Returns how many rows PostgreSQL refused (kept in the rejected table)."""
        spec = self._spec
        assert spec is not None
        params = {
            "writer": self.writer_key,
            "token": token,
            "checkpoint": checkpoint_id,
            "task": self.task_key,
        }
        refused = 0
        connection = self._conn()
        with connection.transaction(), connection.cursor() as cursor:
            # One apply of a staged checkpoint at a time (its old owner's commit and its
            # new owner's recovery can meet): the second finds the rows gone, a no-op,
            # instead of copying refused rows to the rejected table a second time.
            cursor.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))",
                (f"snapline-apply:{self.writer_key}:{token}:{checkpoint_id}",),
            )
            try:
                with connection.transaction():  # a savepoint
                    cursor.execute(apply_sql(spec), params)
            except _ROW_REFUSALS as exc:
                log.warning(
                    "%s: checkpoint %d has rows PostgreSQL refuses (%s); applying row by row",
                    self._sink.name,
                    checkpoint_id,
                    exc.sqlstate,
                )
                refused = self._apply_row_by_row(cursor, spec, params)
            self._context.fault_point("mid_sink_apply")
            cursor.execute(
                sql.SQL(
                    "INSERT INTO {0} AS t (task, checkpoint) VALUES (%(task)s, "
                    "%(checkpoint)s) ON CONFLICT (task) DO UPDATE SET checkpoint = "
                    "GREATEST(t.checkpoint, EXCLUDED.checkpoint)"
                ).format(spec.tasks),
                params,
            )
            cursor.execute(
                sql.SQL(
                    "DELETE FROM {} WHERE writer = %(writer)s AND ("
                    "(token = %(token)s AND checkpoint_id = %(checkpoint)s) OR "
                    "(token <> %(mine)s AND checkpoint_id <= %(checkpoint)s))"
                ).format(spec.staging),
                {**params, "mine": self.token},
            )
        return refused

    def _apply_row_by_row(
        self, cursor: psycopg.Cursor[Any], spec: TableSpec, params: dict[str, Any]
    ) -> int:
        """Apply the checkpoint's rows one statement each, keeping the ones PostgreSQL refuses
        in the rejected table (in the caller's transaction); returns how many it refused.

        In key order, as the bulk upsert locks them, and a key's rows in seq order (its last
        row applied last: the last write of a key wins, as in the bulk upsert, unless the
        database refuses it). In seq order, this pass and another writer's bulk upsert (or
        its row-by-row pass) took the locks of shared keys in crossed orders and deadlocked
        (40P01), which cost the worker a restart."""
        # The checkpoint's rows in a temporary table indexed by seq: each single-row
        # statement looked its row up in the staging table by (writer, checkpoint) only, a
        # scan of the checkpoint's rows per row (a checkpoint of 100k rows with one refused
        # row never finished applying, and every restart began it again).
        rows = sql.Identifier("snapline_apply_rows")
        cursor.execute(
            sql.SQL(
                "CREATE TEMPORARY TABLE {} ON COMMIT DROP AS SELECT * FROM {} "
                "WHERE writer = %(writer)s AND token = %(token)s "
                "AND checkpoint_id = %(checkpoint)s"
            ).format(rows, spec.staging),
            params,
        )
        cursor.execute(sql.SQL("CREATE INDEX ON {} (seq)").format(rows))
        cursor.execute(sql.SQL("ANALYZE {}").format(rows))
        single = apply_sql(spec, single_row=True, staging=rows)
        connection = cursor.connection
        refused = 0
        for seq in self._in_key_order(cursor, spec, rows):
            try:
                with connection.transaction():
                    cursor.execute(single, {**params, "seq": seq})
            except _ROW_REFUSALS as exc:
                refused += 1
                cursor.execute(
                    sql.SQL(
                        "INSERT INTO {} (writer, checkpoint_id, seq, row, sqlstate, error) "
                        "SELECT writer, checkpoint_id, seq, row, %(state)s, %(error)s "
                        "FROM {} WHERE writer = %(writer)s AND token = %(token)s "
                        "AND checkpoint_id = %(checkpoint)s AND seq = %(seq)s"
                    ).format(spec.rejected, rows),
                    {**params, "seq": seq, "state": exc.sqlstate, "error": str(exc)[:2000]},
                )
                log.warning(
                    "%s: row %d of checkpoint %d rejected by PostgreSQL (%s); kept in %s",
                    self._sink.name,
                    seq,
                    params["checkpoint"],
                    exc.sqlstate,
                    spec.rejected.as_string(connection),
                )
        return refused

    def _in_key_order(
        self, cursor: psycopg.Cursor[Any], spec: TableSpec, rows: sql.Identifier
    ) -> list[int]:
        """The seqs of the rows in ``rows`` by key, sorted as the bulk upsert sorts them (the
        key columns' types and collations), then by seq (``key_order_sql``)."""
        statements = key_order_sql(spec, rows, sql.Identifier("snapline_apply_keys"))
        connection = cursor.connection
        cursor.execute(statements.create)
        try:
            with connection.transaction():
                cursor.execute(statements.fill)
        except _ROW_REFUSALS:
            # A key PostgreSQL cannot read (a bad enum label, inet...; or a NOT NULL domain
            # column, read as NULL without the row's other values): read each row's key as
            # its apply reads the row. A row that cannot be read is refused by its apply
            # before it locks anything, so where it comes (last) does not matter.
            seqs = cursor.execute(sql.SQL("SELECT seq FROM {} ORDER BY seq").format(rows))
            for (seq,) in seqs.fetchall():
                try:
                    with connection.transaction():
                        cursor.execute(statements.fill_row, {"seq": seq})
                except _ROW_REFUSALS:
                    pass
        return [int(seq) for (seq,) in cursor.execute(statements.ordered).fetchall()]

    def _applied_id(self) -> int | None:
        """The highest checkpoint id this task applied to the table (``tasks_ddl``), read in
        a transaction of its own, again if PostgreSQL rolled it back (``_run_transaction``: a
        deadlock with a session that holds the tasks table's index and waits to lock the
        table, a REINDEX that goes on to ALTER it, failed the recovery as an outage). Running
        it again is safe: it reads one row and writes nothing."""
        spec = self._spec
        assert spec is not None

        def once() -> tuple[Any, ...] | None:
            connection = self._conn()
            with connection.transaction():
                return connection.execute(
                    sql.SQL("SELECT checkpoint FROM {} WHERE task = %s").format(spec.tasks),
                    (self.task_key,),
                ).fetchone()

        row = self._run_transaction(
            once, "the read of the applied checkpoint ids", "read the applied checkpoint ids", "of"
        )
        return None if row is None else int(row[0])

    def _delete_staged(self, from_checkpoint: int) -> None:
        """Delete this writer instance's own staged rows of checkpoints ≥ n."""
        spec = self._spec
        assert spec is not None
        self._delete(
            sql.SQL(
                "DELETE FROM {} WHERE writer = %s AND token = %s AND checkpoint_id >= %s"
            ).format(spec.staging),
            (self.writer_key, self.token, from_checkpoint),
            f"this writer's staged rows of checkpoints >= {from_checkpoint}",
        )

    def _delete_dead(self, committed: int) -> None:
        """Delete the task's staged rows of checkpoints ≤ ``committed`` (any writer instance):
        checkpoint ``committed`` committed and its listed rows are applied, so nothing else
        at or below it can ever be."""
        spec = self._spec
        assert spec is not None
        self._delete(
            sql.SQL("DELETE FROM {} WHERE writer = %s AND checkpoint_id <= %s").format(
                spec.staging
            ),
            (self.writer_key, committed),
            f"the task's staged rows of checkpoints <= {committed}",
        )

    def _delete(self, statement: sql.Composed, params: tuple[Any, ...], rows: str) -> None:
        """Run ``statement``, a DELETE of staged rows, in a transaction of its own, again if
        PostgreSQL rolled it back (``_run_transaction``). Running it again is safe: the
        transaction is that one statement, which PostgreSQL rolled back whole, and deleting
        the same rows again deletes what is left of them."""

        def once() -> None:
            connection = self._conn()
            with connection.transaction():
                connection.execute(statement, params)

        self._run_transaction(once, f"the deletion of {rows}", "delete staged rows", "in")


# --------------------------------------------------------------------------- catalog


@dataclass(frozen=True)
class _Column:
    name: str
    type_name: str
    display_type: str
    not_null: bool
    has_default: bool
    typmod: int
    is_array: bool
    generated: bool

    def spec(self, is_key: bool) -> ColumnSpec:
        max_length = None
        if self.type_name in ("varchar", "bpchar") and self.typmod > 4:
            max_length = self.typmod - 4
        return ColumnSpec(
            self.name,
            self.type_name,
            self.display_type,
            self.not_null,
            self.has_default,
            max_length,
            self.is_array,
            is_key,
        )


def _read_columns(connection: psycopg.Connection[Any], relid: int) -> list[_Column]:
    rows = connection.execute(
        "SELECT a.attname::text, "
        "CASE WHEN t.typtype = 'd' THEN bt.typname ELSE t.typname END::text, "
        "format_type(a.atttypid, a.atttypmod), a.attnotnull, a.atthasdef, "
        "CASE WHEN t.typtype = 'd' THEN t.typtypmod ELSE a.atttypmod END, "
        "(CASE WHEN t.typtype = 'd' THEN bt.typcategory ELSE t.typcategory END) = 'A', "
        "a.attgenerated <> '' OR a.attidentity = 'a' "
        "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
        "LEFT JOIN pg_type bt ON bt.oid = t.typbasetype "
        "WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
        (relid,),
    ).fetchall()
    return [_Column(*row) for row in rows]


def _check_fence_types(present: dict[str, _Column], qualified: str) -> None:
    expected = {CHECKPOINT_COLUMN: "int8", TASK_COLUMN: "text"}
    for name, type_name in expected.items():
        if present[name].type_name != type_name:
            raise ConfigurationError(
                f"{qualified}.{name} is {present[name].display_type}; the sink's fence column "
                f"must be {'bigint' if type_name == 'int8' else 'text'}: ALTER TABLE "
                f"{qualified} ALTER COLUMN {name} TYPE "
                f"{'bigint' if type_name == 'int8' else 'text'}"
            )
