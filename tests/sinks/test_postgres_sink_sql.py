"""PostgresSink without a database: the SQL it runs, row checks and encoding, configuration."""

from __future__ import annotations

import contextlib
import math
import random
import sys
import uuid
from collections.abc import Iterator
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql

from snapline.pipeline.errors import ConfigurationError, SinkUnavailableError
from snapline.pipeline.sink import SinkContext
from snapline.sinks.postgres import (
    MAX_IDENTIFIER,
    SESSION_TIMEOUT,
    TRANSACTION_ATTEMPTS,
    TRANSACTION_RETRY_DELAY,
    TRANSACTION_RETRY_MAX_DELAY,
    ColumnSpec,
    PostgresSink,
    RowEncoder,
    TableSpec,
    apply_sql,
    derived_name,
    key_order_sql,
    rejected_ddl,
    split_table_name,
    staging_ddl,
    transaction_retry_delay,
)

COLUMNS = (
    ColumnSpec("customer", "text", "text", not_null=True, is_key=True),
    ColumnSpec("total", "numeric", "numeric"),
    ColumnSpec("n", "int4", "integer"),
    ColumnSpec("code", "varchar", "character varying(3)", max_length=3),
    ColumnSpec("day", "date", "date"),
    ColumnSpec("seen", "timestamptz", "timestamp with time zone"),
    ColumnSpec("ok", "bool", "boolean"),
    ColumnSpec("ratio", "float8", "double precision"),
    ColumnSpec("doc", "jsonb", "jsonb"),
    ColumnSpec("id", "uuid", "uuid"),
    ColumnSpec("blob", "bytea", "bytea"),
    ColumnSpec("tags", "int4", "integer[]", is_array=True),
    ColumnSpec("required", "text", "text", not_null=True),
    ColumnSpec("defaulted", "text", "text", not_null=True, has_default=True),
)
SPEC = TableSpec("sales", "totals", COLUMNS, ("customer",))


def render(composed: Any) -> str:
    return str(composed.as_string(None))


def encode(row: Any) -> dict[str, Any] | str:
    result = RowEncoder(COLUMNS).encode(row)
    return orjson.loads(result) if isinstance(result, bytes) else result


BASE = {"customer": "c1", "required": "r", "defaulted": "d"}


# --------------------------------------------------------------------------- SQL


def test_apply_sql_is_one_fenced_upsert_of_the_last_row_per_key() -> None:
    text = render(apply_sql(SPEC))
    assert 'FROM "sales"."totals__snapline_staging" AS s' in text
    assert 'jsonb_populate_record(NULL::"sales"."totals", s.row)' in text
    assert 'SELECT DISTINCT ON (r."customer")' in text
    assert 'ORDER BY r."customer", s.seq DESC' in text  # the last write of a key wins
    assert 'ON CONFLICT ("customer") DO UPDATE SET' in text
    assert '"customer" = EXCLUDED."customer"' not in text  # keys are never updated
    assert '"total" = EXCLUDED."total"' in text
    assert '"_snapline_checkpoint" = EXCLUDED."_snapline_checkpoint"' in text
    assert (
        'WHERE t."_snapline_task" IS DISTINCT FROM EXCLUDED."_snapline_task" OR '
        't."_snapline_checkpoint" IS NULL OR '
        't."_snapline_checkpoint" <= EXCLUDED."_snapline_checkpoint"'
    ) in text
    assert "s.writer = %(writer)s AND s.token = %(token)s" in text
    assert "SELECT " + '"customer", "total"' in text and "__snapline_checkpoint, %(task)s" in text
    assert "%(seq)s" not in text
    assert "s.seq = %(seq)s" in render(apply_sql(SPEC, single_row=True))
    # Rows are inserted, so locked, in key order (the row-by-row apply keeps it).
    assert 'FROM src ORDER BY "customer" ON CONFLICT' in text


def test_the_row_by_row_order_is_the_upserts_key_order_then_seq() -> None:
    spec = TableSpec(
        "public",
        "pairs",
        (
            ColumnSpec("a", "int8", "bigint", is_key=True),
            ColumnSpec("seq", "text", "text", is_key=True),  # names of its own never clash
            ColumnSpec("v", "text", "text"),
        ),
        ("a", "seq"),
    )
    order = key_order_sql(spec, sql.Identifier("rows"), sql.Identifier("keys"))
    populate = 'jsonb_populate_record(NULL::"public"."pairs", '
    # Typed as the target's key columns (their types and collations sort as the upsert's).
    assert render(order.create) == (
        'CREATE TEMPORARY TABLE "keys" ON COMMIT DROP AS SELECT s.seq, r."a" AS "key_0", '
        'r."seq" AS "key_1" FROM "rows" AS s CROSS JOIN LATERAL ' + populate + "s.row) AS r "
        "WITH NO DATA"
    )
    # Every row's key at once, reading the key columns only.
    assert populate + "jsonb_build_object('a'::text, s.row -> 'a', 'seq'::text, " in render(
        order.fill
    )
    assert render(order.fill).startswith('INSERT INTO "keys" SELECT s.seq, r."a" AS "key_0"')
    # One row, read whole as its apply reads it.
    assert render(order.fill_row).endswith(populate + "s.row) AS r WHERE s.seq = %(seq)s")
    assert render(order.ordered) == (
        'SELECT s.seq FROM "rows" AS s LEFT JOIN "keys" AS k ON k.seq = s.seq '
        'ORDER BY k."key_0", k."key_1", s.seq'
    )


def test_retries_of_a_rolled_back_transaction_are_few_short_and_jittered() -> None:
    rng = random.Random(1)
    delays = [
        [transaction_retry_delay(a, rng) for a in range(1, TRANSACTION_ATTEMPTS)]
        for _ in range(200)
    ]
    for attempt, seen in enumerate(zip(*delays, strict=True), start=1):
        most = min(TRANSACTION_RETRY_MAX_DELAY, TRANSACTION_RETRY_DELAY * 2 ** (attempt - 1))
        assert all(most / 2 <= d <= most for d in seen)
        assert len(set(seen)) > 100  # two writers that deadlocked do not retry in step
    assert 2 <= TRANSACTION_ATTEMPTS <= 10
    assert sum(max(s) for s in zip(*delays, strict=True)) < 5  # the worker waits seconds at most


def test_composite_keys_and_key_only_tables() -> None:
    spec = TableSpec(
        "public",
        "pairs",
        (
            ColumnSpec("a", "int8", "bigint", is_key=True),
            ColumnSpec("b", "text", "text", is_key=True),
        ),
        ("a", "b"),
    )
    text = render(apply_sql(spec))
    assert 'ON CONFLICT ("a", "b")' in text
    assert 'DO UPDATE SET "_snapline_checkpoint"' in text


def test_staging_and_rejected_tables() -> None:
    table, index = (render(s) for s in staging_ddl(SPEC))
    assert 'CREATE TABLE IF NOT EXISTS "sales"."totals__snapline_staging"' in table
    assert "row jsonb NOT NULL" in table and "PRIMARY KEY" not in table
    assert 'ON "sales"."totals__snapline_staging" (writer, checkpoint_id)' in index
    assert '"sales"."totals__snapline_rejected"' in render(rejected_ddl(SPEC))


def test_derived_names_fit_postgres_identifiers() -> None:
    assert derived_name("orders", "__snapline_staging") == "orders__snapline_staging"
    long_a, long_b = "x" * 60 + "a", "x" * 60 + "b"
    name_a = derived_name(long_a, "__snapline_staging")
    name_b = derived_name(long_b, "__snapline_staging")
    assert len(name_a.encode()) <= MAX_IDENTIFIER and name_a.endswith("__snapline_staging")
    assert name_a != name_b
    assert len(derived_name("é" * 40, "__snapline_rejected").encode()) <= MAX_IDENTIFIER


def test_split_table_name() -> None:
    assert split_table_name("totals") == ("public", "totals")
    assert split_table_name("sales.totals") == ("sales", "totals")
    for bad in ("", "a.b.c", ".t", "s."):
        with pytest.raises(ConfigurationError):
            split_table_name(bad)


# --------------------------------------------------------------------------- row checks


def test_values_of_every_kind_are_encoded() -> None:
    row = {
        **BASE,
        "total": Decimal("12.50"),
        "n": 7.0,
        "code": "abc",
        "day": date(2024, 1, 2),
        "seen": datetime(2024, 1, 2, 3, 4, 5),
        "ok": True,
        "ratio": math.inf,
        "doc": {"nested": [1, {"x": None}]},
        "id": uuid.UUID(int=1),
        "blob": b"\x00\xff",
        "tags": (1, 2),
        "ignored": object(),
    }
    assert encode(row) == {
        **BASE,
        "total": "12.50",
        "n": 7,
        "code": "abc",
        "day": "2024-01-02",
        "seen": "2024-01-02T03:04:05",
        "ok": True,
        "ratio": "Infinity",
        "doc": {"nested": [1, {"x": None}]},
        "id": "00000000-0000-0000-0000-000000000001",
        "blob": "\\x00ff",
        "tags": [1, 2],
    }


def test_strings_that_parse_are_accepted() -> None:
    got = encode(
        {
            **BASE,
            "n": " 42 ",
            "total": "1e3",
            "ratio": "NaN",
            "day": "2024-02-29",
            "seen": "2024-02-29T10:00:00+01:00",
            "id": str(uuid.UUID(int=5)),
        }
    )
    assert isinstance(got, dict)
    assert got["n"] == 42 and got["total"] == "1e3" and got["day"] == "2024-02-29"


def test_missing_columns_are_null_unless_required() -> None:
    got = encode(dict(BASE))
    assert isinstance(got, dict) and got["total"] is None and got["defaulted"] == "d"
    no_default = encode({"customer": "c"})
    assert no_default == "missing NOT NULL column 'required' (text)"
    assert encode({"required": "r"}) == "missing key column 'customer' (text)"
    assert isinstance(encode({"customer": "c", "required": "r"}), dict)  # default column: NULL


@pytest.mark.parametrize(
    ("values", "reason"),
    [
        ({"n": "seven"}, "column 'n' (integer) expects an integer, got 'seven'"),
        ({"n": 1.5}, "column 'n' (integer) expects an integer, got float"),
        ({"n": True}, "expects an integer, got bool"),
        ({"n": 2**31}, "2147483648 is out of range"),
        ({"total": "lots"}, "column 'total' (numeric) expects a number"),
        ({"ok": "yes"}, "column 'ok' (boolean) expects a boolean, got str"),
        ({"code": "abcd"}, "is 4 characters long, more than 3"),
        ({"customer": 5}, "column 'customer' (text) expects a string, got int"),
        ({"day": "2024-13-01"}, "'2024-13-01' is not a date"),
        ({"day": datetime(2024, 1, 1)}, "expects a date, got datetime"),
        ({"id": "not-a-uuid"}, "is not a uuid"),
        ({"tags": 3}, "expects a list, got int"),
        ({"blob": "text"}, "expects bytes, got str"),
        ({"doc": {1: "x"}}, "cannot encode the row as JSON"),
        ({"doc": {"x": object()}}, "cannot encode the row as JSON"),
        ({"code": "a\x00"}, "NUL character"),
    ],
)
def test_rows_that_do_not_fit_say_why(values: dict[str, Any], reason: str) -> None:
    got = encode({**BASE, **values})
    assert isinstance(got, str) and reason in got


def test_non_dict_rows_do_not_fit() -> None:
    assert encode(["c1"]) == "row is a list, a PostgreSQL table needs a dict"


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dsn": "", "table": "t", "key_columns": ["k"]}, "needs a dsn"),
        ({"dsn": "postgresql://h/db", "table": "a.b.c", "key_columns": ["k"]}, "schema.table"),
        ({"dsn": "postgresql://h/db", "table": "t", "key_columns": []}, "needs key_columns"),
        (
            {"dsn": "postgresql://h/db", "table": "t", "key_columns": ["_snapline_task"]},
            "fence column",
        ),
        (
            {"dsn": "postgresql://h/db", "table": "t", "key_columns": ["k"], "columns": ["v"]},
            "lack the key columns",
        ),
    ],
)
def test_configuration_errors_name_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        PostgresSink(**kwargs)


def test_sink_defaults() -> None:
    sink = PostgresSink("postgresql://h/db", "sales.totals", "customer")
    assert sink.key_columns == ("customer",) and sink.name == "postgres:sales.totals"


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("postgresql://app:FAKEPW@db:54x2/shop", "port '54x2' is not a port number"),
        ("host=db port=99999 password=FAKEPW", "port '99999' is not a port number"),
        ("postgresql://app:FAKEPW@db/shop?sslmode=on", "sslmode 'on' is not one of"),
        ("postgresql://app:FAKEPW@db/shop?nope=1", "dsn is not valid"),
        ("db shop FAKEPW", "dsn is not valid"),
        # Each of these was accepted, and failed at every connection (exit 75 without end).
        (
            "postgresql://app:FAKEPW@db/shop?target_session_attrs=bogus",
            "dsn: target_session_attrs 'bogus' is not one of any, read-write, read-only, "
            "primary, standby, prefer-standby",
        ),
        ("host=db password=FAKEPW target_session_attrs=", "target_session_attrs '' is not one"),
        ("host=db password=FAKEPW keepalives_idle=abc", r"keepalives_idle 'abc' is not an integer"),
        ("host=db password=FAKEPW keepalives_interval=1.5", "keepalives_interval '1.5' is not an"),
        ("host=db password=FAKEPW keepalives_count=", "keepalives_count '' is not an integer"),
        ("host=db password=FAKEPW tcp_user_timeout=9999999999", "tcp_user_timeout '9999999999'"),
        ("host=db password=FAKEPW connect_timeout=x", r"connect_timeout 'x' is not a number"),
        ("host=db password=FAKEPW keepalives=maybe", r"keepalives 'maybe' is not an integer"),
        ("host=db password=FAKEPW hostaddr=not-an-ip", "hostaddr 'not-an-ip' is not a numeric IP"),
        ("host=a,b password=FAKEPW hostaddr='10.0.0.1, ::1'", "hostaddr ' ::1' is not a numeric"),
        ("host=db password=FAKEPW gssencmode=bogus", "gssencmode 'bogus' is not one of disable"),
        ("host=db password=FAKEPW channel_binding=bogus", "channel_binding 'bogus' is not one of"),
        ("host=db password=FAKEPW load_balance_hosts=no", "load_balance_hosts 'no' is not one of"),
        ("host=db password=FAKEPW sslnegotiation=bogus", "sslnegotiation 'bogus' is not one of"),
        ("host=db password=FAKEPW sslcertmode=bogus", "sslcertmode 'bogus' is not one of"),
        ("host=a,b password=FAKEPW hostaddr=10.0.0.1", "hostaddr gives 1 addresses for the 2"),
        ("postgresql://app:FAKEPW@db1,db2/shop?port=1,2,3", "port gives 3 ports for 2 hosts"),
        ("postgresql://app:FAKEPW@db/shop?keepalives=FAKEPW", "keepalives '\\*\\*\\*' is not"),
    ],
)
def test_a_dsn_libpq_cannot_use_fails_at_start_without_its_password(dsn: str, message: str) -> None:
    """A malformed DSN was accepted, then failed at the first connection as an
    OperationalError, taken for a database down: the worker exited 75 and was restarted for
    it without end."""
    with pytest.raises(ConfigurationError, match=message) as refused:
        PostgresSink(dsn, "totals", ["customer"])
    assert "FAKEPW" not in str(refused.value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's setsockopt ranges")
@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        (
            "host=db password=FAKEPW keepalives_idle=0",
            r"keepalives_idle '0' is not within 1\.\.32767",
        ),
        (
            "host=db password=FAKEPW keepalives_interval=-1",
            "keepalives_interval '-1' is not within",
        ),
        ("host=db password=FAKEPW keepalives_count=128", r"keepalives_count '128' .* 1\.\.127"),
    ],
)
def test_keepalive_values_linux_refuses_fail_at_start(dsn: str, message: str) -> None:
    """libpq passes these to setsockopt, which refuses them (EINVAL) at every connection:
    0 too, which libpq's documentation calls the system default."""
    with pytest.raises(ConfigurationError, match=message) as refused:
        PostgresSink(dsn, "totals", ["customer"])
    assert "FAKEPW" not in str(refused.value)


def fragments(secret: str) -> set[str]:
    """Every piece of ``secret`` of 3 characters or more."""
    return {secret[i:j] for i in range(len(secret)) for j in range(i + 3, len(secret) + 1)}


@pytest.mark.parametrize(
    ("dsn", "secret", "message"),
    [
        # libpq ends the user info at the '/': host 'user', port 'hunter2', dbname 'x@db...'.
        (
            "postgresql://user:hunter2/x@db:5432/app",
            "hunter2/x",
            "the URI's path .* holds an '@'.*percent-encode '@', '/'",
        ),
        ("postgresql://user:p@ss:word@h:5432/app", "p@ss:word", r"port '\*\*\*@h:5432'"),
        # A port libpq takes: accepted, and the first connection went to host 'app'.
        ("postgresql://app:1234/x9q@db/shop", "1234/x9q", "holds an '@'"),
        # Port 'zq' (2 characters, masked as a piece of the password), dbname 'x', and the
        # query 'keepalives=kw9q@db/shop'.
        ("postgresql://app:zq/x?keepalives=kw9q@db/shop", "zq/x?keepalives=kw9q", r"port '\*\*\*'"),
        # Port 1, dbname 'x', and host 'kw9q@db' from the query: accepted, and libpq's error
        # at every connection quoted the host.
        ("postgresql://app:1/x?host=kw9q@db", "1/x?host=kw9q", r"host '\*\*\*@db' is not a"),
        ("postgresql://app:kq%zzw@db/shop", "kq%zzw", r'percent-encoded token: "\*\*\*"'),
        ("postgresql://app:k q w@db/shop", "k q w", r'unexpected spaces found in "\*\*\*"'),
        ("postgresql://app:kq@[w@db/shop", "kq@[w", 'matching "]"'),
        ("host=db password='k9 qw' sslmode=k9", "k9 qw", r"sslmode '\*\*\*' is not one of"),
    ],
)
def test_no_piece_of_a_password_is_in_a_refusal(dsn: str, secret: str, message: str) -> None:
    """A password with an unencoded '/' or '@' in a URI is split by libpq among the host, the
    port, the database and the query: ``postgresql://user:hunter2/x@db:5432/app`` was refused
    with ``port 'hunter2'``, ``p@ss:word`` with ``port 'word@h'`` (only the whole password,
    as a regular expression found it, was masked)."""
    with pytest.raises(ConfigurationError, match=message) as refused:
        PostgresSink(dsn, "totals", ["customer"])
    text = str(refused.value)
    named = fragments("host")  # the option a message names, not a piece of the DSN it quotes
    assert not [piece for piece in fragments(secret) - named if piece in text], text


@pytest.mark.parametrize(
    "dsn",
    [
        "host=/var/run/postgresql keepalives_idle=0",
        "host=/tmp,@abstract keepalives_count=0 keepalives_interval=-1",
        "postgresql:///shop?host=/var/run/postgresql&keepalives_idle=0",
    ],
)
def test_keepalive_values_are_not_checked_for_unix_sockets(dsn: str) -> None:
    """libpq applies the keepalive options to TCP connections only: a Unix-socket DSN with
    ``keepalives_idle=0`` connects, and was refused."""
    PostgresSink(dsn, "totals", ["customer"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's setsockopt ranges")
@pytest.mark.parametrize(
    "dsn",
    [
        "host=/tmp,db keepalives_idle=0",  # one TCP host
        "host=/tmp hostaddr=127.0.0.1 keepalives_idle=0",  # hostaddr: TCP
        "keepalives_idle=0",  # PGHOST may name a TCP host
    ],
)
def test_keepalive_values_are_checked_where_a_host_may_be_tcp(dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="keepalives_idle '0' is not within"):
        PostgresSink(dsn, "totals", ["customer"])


@pytest.mark.parametrize("autocommit", [True, False])
def test_autocommit_in_connect_kwargs_fails_at_start(autocommit: bool) -> None:
    """The sink passes autocommit=True itself: psycopg.connect raised TypeError (a keyword
    argument given twice) at the first connection, and the check's message suggested it."""
    with pytest.raises(ConfigurationError, match="autocommit is the sink's own.*remove it"):
        PostgresSink(
            "postgresql://db/shop",
            "totals",
            ["customer"],
            connect_kwargs={"autocommit": autocommit},
        )
    with pytest.raises(ConfigurationError, match="connect_kwargs are not valid") as refused:
        PostgresSink("postgresql://db/shop", "totals", ["customer"], connect_kwargs={"nope": 1})
    assert "autocommit" not in str(refused.value)


class _TupleCursor(psycopg.Cursor[Any]):
    """A cursor class of the user's own (what cursor_factory takes)."""


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("row_factory", psycopg.rows.dict_row, "its queries read their rows as tuples"),
        ("row_factory", None, "its queries read their rows as tuples"),
        ("cursor_factory", _TupleCursor, "its queries run on psycopg's own cursors"),
        ("context", psycopg.adapt.AdaptersMap(psycopg.adapters), "psycopg's default adapters"),
    ],
)
def test_connect_arguments_that_change_the_sinks_queries_fail_at_start(
    name: str, value: Any, why: str
) -> None:
    """A row_factory (or a cursor class, or adapters) of the user's gave the sink's own
    queries rows of another shape: accepted when the sink was built, it failed its setup at
    every connection, and the worker was restarted without end. Refused as autocommit is."""
    with pytest.raises(ConfigurationError, match=rf"connect_kwargs: {name} is the sink's own") as e:
        PostgresSink(
            "postgresql://db/shop",
            "totals",
            ["customer"],
            connect_kwargs={name: value, "sslmode": "require"},
        )
    assert why in str(e.value) and str(e.value).endswith("; remove it")


def test_every_argument_of_psycopg_connect_is_taken_or_refused() -> None:
    """Each keyword-only argument of psycopg.connect is either one connect_kwargs may hold or
    one the sink refuses (any other key is checked as a libpq option: a psycopg upgrade's new
    argument would be refused as "not valid" until it is named here). Checked against the
    psycopg this project was written for; a later one may add arguments (then this says so
    only as a subset: the named ones must exist)."""
    import inspect

    from snapline.sinks.postgres_connect import _PSYCOPG_ARGUMENTS, _SINKS_OWN_ARGUMENTS

    arguments = {
        name
        for name, parameter in inspect.signature(psycopg.connect).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    named = _PSYCOPG_ARGUMENTS | _SINKS_OWN_ARGUMENTS.keys()
    assert named <= arguments
    if tuple(int(p) for p in psycopg.__version__.split(".")[:2]) <= (3, 3):
        assert arguments == named
    assert not _PSYCOPG_ARGUMENTS & _SINKS_OWN_ARGUMENTS.keys()
    PostgresSink("postgresql://db/shop", "t", ["k"], connect_kwargs={"prepare_threshold": 0})


@pytest.mark.parametrize(
    "error",
    [
        psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),
        psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"),
    ],
)
def test_a_statement_past_the_sessions_bound_says_how_to_allow_longer(error: Exception) -> None:
    """An outage (exit 75, the restart runs it again) whose message names the session's bound
    and how to raise it, for an apply that needs longer than SESSION_TIMEOUT."""
    sink = PostgresSink("postgresql://app:FAKEPW@db/shop", "totals", ["customer"])
    context = SinkContext("job", "orders-0", "w1", sink.name, None, lambda *a: None)  # type: ignore[arg-type]
    failure = sink.open(context)._fail(error, "commit checkpoint 3 into")
    assert isinstance(failure, SinkUnavailableError)
    assert f"after {SESSION_TIMEOUT} s" in str(failure)
    assert "options='-c statement_timeout=... -c lock_timeout=...' in the dsn" in str(failure)
    assert "FAKEPW" not in str(failure)


@pytest.mark.parametrize(
    ("connect_kwargs", "message"),
    [
        ({"port": "54x2", "password": "FAKEPW"}, "connect_kwargs: port '54x2' is not a port"),
        ({"nope": 1, "password": "FAKEPW"}, 'connect_kwargs are not valid: .*"nope"'),
        ({"sslmode": "on", "password": "FAKEPW"}, "connect_kwargs: sslmode 'on' is not one of"),
        ({"keepalives_idle": "FAKEPW", "password": "FAKEPW"}, "keepalives_idle '\\*\\*\\*'"),
        ({"keepalives_idle": "1FAKEP", "password": "FAKEPW"}, "keepalives_idle '1\\*\\*\\*'"),
        ({"connect_timeout": "soon"}, "connect_kwargs: connect_timeout 'soon' is not a number"),
    ],
)
def test_connect_kwargs_libpq_cannot_use_fail_at_start(
    connect_kwargs: dict[str, Any], message: str
) -> None:
    """``connect_kwargs`` win over the DSN's options at the connection: checked the same way."""
    with pytest.raises(ConfigurationError, match=message) as refused:
        PostgresSink("postgresql://db/shop", "totals", ["customer"], connect_kwargs=connect_kwargs)
    assert "FAKEPW" not in str(refused.value)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app@db1:5432,db2:5433/shop?sslmode=verify-full",
        "postgresql://app@db1,db2:5433/shop",  # one port for every host
        "host=db1,db2 hostaddr=,10.0.0.2 port=5432",  # an empty hostaddr: look the name up
        "host=db hostaddr=127.1",  # what getaddrinfo reads as numeric, as libpq does
        "host=db hostaddr=fe80::1%eth0",
        "host=db hostaddr=",
        "host=db keepalives=2 keepalives_idle=' 30 ' keepalives_count=+5 tcp_user_timeout=-1",
        "host=db keepalives=0 keepalives_idle=0",  # keepalives off: libpq ignores the rest
        "host=db connect_timeout=2.5",  # psycopg reads it as a number
        "host=db target_session_attrs=prefer-standby load_balance_hosts=random "
        "gssencmode=disable channel_binding=require sslnegotiation=direct sslmode=require "
        "sslcertmode=allow",
        "port=5432,5433",  # PGHOST may name two hosts: not checked here
    ],
)
def test_dsns_libpq_can_use_are_accepted(dsn: str) -> None:
    PostgresSink(dsn, "t", ["k"], connect_kwargs={"prepare_threshold": None})


@pytest.mark.parametrize(
    ("message", "refused"),
    [
        ('FATAL:  password authentication failed for user "app"', True),
        ("fe_sendauth: no password supplied", True),
        ('FATAL:  pg_hba.conf rejects connection for host "10.0.0.5", user "app"', True),
        ('FATAL:  no pg_hba.conf entry for host "10.0.0.5", user "app"', True),
        ('FATAL:  role "app" is not permitted to log in', True),
        ('FATAL:  database "shop" does not exist', True),
        # A bad options=-c ... in the DSN, which only the server can check.
        ('FATAL:  invalid value for parameter "statement_timeout": "abc"', True),
        ('FATAL:  unrecognized configuration parameter "statment_timeout"', True),
        ('FATAL:  permission denied to set parameter "log_min_duration_statement"', True),
        # LDAP, PAM, RADIUS, GSSAPI: also what a server says while its LDAP server or KDC is
        # down, an outage that restarts wait out.
        ('FATAL:  LDAP authentication failed for user "app"', False),
        ('FATAL:  PAM authentication failed for user "app"', False),
        ("connection failed: Connection refused", False),
    ],
)
def test_a_refused_connection_is_told_apart_from_an_outage(message: str, refused: bool) -> None:
    from snapline.sinks.postgres_connect import REFUSED

    assert bool(REFUSED.search(message)) is refused


# --------------------------------------------------------------------------- rolled-back retries


class _FakeSession:
    """A connection of the sink's that records its transactions' statements, and fails the
    first ``times`` statements starting with ``failing`` as PostgreSQL does when it rolls the
    transaction back (psycopg raises them at the statement's end; a COPY's at its close)."""

    closed = False
    broken = False

    def __init__(self, failing: str, times: int, error: type[psycopg.Error]) -> None:
        self.failing, self.times, self.error = failing, times, error
        self.events: list[str] = []

    def _run(self, statement: Any) -> None:
        word = render(statement).split()[0]
        self.events.append(word)
        if word == self.failing and self.times > 0:
            self.times -= 1
            raise self.error("deadlock detected (raised by the test)")

    def execute(self, statement: Any, params: Any = None) -> Any:
        self._run(statement)
        return self

    def fetchone(self) -> None:
        return None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        self.events.append("BEGIN")
        try:
            yield
        except BaseException:
            self.events.append("ROLLBACK")
            raise
        self.events.append("COMMIT")

    @contextlib.contextmanager
    def cursor(self) -> Iterator[Any]:
        yield self

    @contextlib.contextmanager
    def copy(self, statement: Any) -> Iterator[Any]:
        yield self
        self._run(statement)

    def write(self, data: bytes) -> None:
        lines = data.count(b"\n")
        self.events.append(f"rows:{lines}")

    def close(self) -> None:
        self.closed = True


def _faked_writer(
    monkeypatch: pytest.MonkeyPatch, failing: str, times: int, error: type[psycopg.Error]
) -> tuple[Any, _FakeSession, list[float]]:
    """A writer set up as its first write would (table read) on a ``_FakeSession``; and the
    waits between its attempts, recorded instead of slept."""
    from snapline.sinks import postgres

    sink = PostgresSink("postgresql://app:FAKEPW@db/shop", "sales.totals", ["customer"])
    context = SinkContext("job", "orders-0", "w1", sink.name, None, lambda *a: None)  # type: ignore[arg-type]
    writer = sink.open(context)
    writer._spec, writer._encoder = SPEC, RowEncoder(COLUMNS)
    session = _FakeSession(failing, times, error)
    writer._connection = session
    waits: list[float] = []
    monkeypatch.setattr(postgres, "sleep", waits.append)
    return writer, session, waits


def _stage(writer: Any, rows: int) -> dict[str, Any]:
    from snapline.pipeline.record import Record

    writer.write_batch([Record({**BASE, "n": i}, 0, "orders", 0, i) for i in range(rows)], 3)
    return writer.pre_commit(3).result(timeout=10)  # the background thread never sleeps


@pytest.mark.parametrize(
    "error", [psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure]
)
def test_a_staging_rolled_back_is_run_again_whole(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: type[psycopg.Error]
) -> None:
    """PostgreSQL rolls the staging's transaction back twice (40P01, 40001): its failure
    was an outage (the checkpoint failed, and the worker restarted). The whole transaction
    (the deletion of an earlier attempt's rows, then the COPY) is run again, after jittered
    waits, and the third attempt commits."""
    writer, session, waits = _faked_writer(monkeypatch, "COPY", 2, error)
    with caplog.at_level("WARNING", logger="snapline.sinks.postgres"):
        meta = _stage(writer, rows=2)
    assert meta["pending"] == [{"checkpoint": 3, "token": writer.token, "rows": 2}]
    attempt = ["BEGIN", "DELETE", "rows:2", "COPY"]
    assert session.events == [*attempt, "ROLLBACK", *attempt, "ROLLBACK", *attempt, "COMMIT"]
    assert len(waits) == 2 and 0.05 <= waits[0] <= 0.1 and 0.1 <= waits[1] <= 0.2
    retries = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
    assert len(retries) == 2 and all(
        "rolled back the staging of checkpoint 3" in m for m in retries
    )
    assert "attempt 2 of 5" in retries[0] and error.sqlstate in retries[0]
    writer.close()


def test_a_staging_rolled_back_at_every_attempt_is_an_outage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After TRANSACTION_ATTEMPTS attempts, as the apply: SinkUnavailableError (the checkpoint
    fails; a worker that ends on it exits 75), the connection closed."""
    writer, session, waits = _faked_writer(
        monkeypatch, "COPY", 1000, psycopg.errors.DeadlockDetected
    )
    with pytest.raises(
        SinkUnavailableError,
        match=rf"could not stage checkpoint 3 \({TRANSACTION_ATTEMPTS} attempts\) into "
        r"PostgreSQL at db:5432/shop table 'sales.totals': deadlock detected",
    ) as failed:
        _stage(writer, rows=1)
    assert session.events.count("COPY") == TRANSACTION_ATTEMPTS == session.events.count("ROLLBACK")
    assert len(waits) == TRANSACTION_ATTEMPTS - 1 and session.closed and writer._connection is None
    assert "FAKEPW" not in str(failed.value)
    writer.close()


@pytest.mark.parametrize("deletion", ["recover", "abort"])
def test_a_deletion_of_staged_rows_rolled_back_is_run_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, deletion: str
) -> None:
    """The deletion of dead staged rows after recovery's applies, and of an aborted
    checkpoint's: a deadlock failed the recovery as an outage (the worker exited 75) and left
    the aborted rows behind with a warning. Each runs again in a transaction of its own."""
    writer, session, waits = _faked_writer(
        monkeypatch, "DELETE", 2, psycopg.errors.DeadlockDetected
    )
    with caplog.at_level("WARNING", logger="snapline.sinks.postgres"):
        if deletion == "recover":
            writer.recover(5, {"format": 1, "pending": []})
        else:
            session.times = 0  # the staging goes through; its abort's deletion is rolled back
            _stage(writer, rows=1)
            session.events.clear()
            session.times = 2
            writer.abort(3)
    whole = ["BEGIN", "DELETE"]
    assert session.events[:9] == [*whole, "ROLLBACK", *whole, "ROLLBACK", *whole, "COMMIT"]
    assert len(waits) == 2
    messages = [r.getMessage() for r in caplog.records if "rolled back" in r.getMessage()]
    assert len(messages) == 2 and all("rolled back the deletion of" in m for m in messages)
    assert "could not delete" not in caplog.text
    writer.close()


def test_a_deletion_rolled_back_at_every_attempt_is_an_outage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    writer, session, waits = _faked_writer(
        monkeypatch, "DELETE", 1000, psycopg.errors.DeadlockDetected
    )
    with pytest.raises(
        SinkUnavailableError,
        match=rf"could not delete staged rows \({TRANSACTION_ATTEMPTS} attempts\) in PostgreSQL",
    ):
        writer.recover(5, {"format": 1, "pending": []})
    assert (
        session.events.count("DELETE") == TRANSACTION_ATTEMPTS == session.events.count("ROLLBACK")
    )
    assert len(waits) == TRANSACTION_ATTEMPTS - 1 and session.closed
    writer.close()


# --------------------------------------------------------------------------- TCP defaults

DEFAULTS = {
    "keepalives": "1",
    "keepalives_idle": "20",
    "keepalives_interval": "5",
    "keepalives_count": "4",
    "tcp_user_timeout": "40000",
}


def test_the_tcp_defaults_find_a_server_that_is_gone_within_a_minute() -> None:
    """The documented values (docs/sinks.md): without an answer from the server, a connection
    fails after 20 s + 4 probes 5 s apart, and data unacknowledged for 40 s fails it too."""
    from snapline.sinks.postgres_connect import TCP_DEFAULTS

    assert dict(TCP_DEFAULTS) == DEFAULTS
    probing = int(DEFAULTS["keepalives_idle"]) + int(DEFAULTS["keepalives_interval"]) * int(
        DEFAULTS["keepalives_count"]
    )
    assert 30 <= probing <= 60 and 30 <= int(DEFAULTS["tcp_user_timeout"]) / 1000 <= 60


@pytest.mark.parametrize(
    ("dsn", "connect_kwargs", "added"),
    [
        ("postgresql://app:FAKEPW@db/shop", {}, DEFAULTS),
        ("host=db dbname=shop password=FAKEPW", {}, DEFAULTS),
        # The DSN's own win, as a URI's query or key=value settings.
        (
            "postgresql://app:FAKEPW@db/shop?keepalives_idle=7&tcp_user_timeout=0",
            {},
            {k: v for k, v in DEFAULTS.items() if k not in ("keepalives_idle", "tcp_user_timeout")},
        ),
        (
            "host=db keepalives=0 keepalives_count=9",
            {},
            {k: v for k, v in DEFAULTS.items() if k not in ("keepalives", "keepalives_count")},
        ),
        # connect_kwargs' win; None leaves the option to libpq and the system.
        (
            "postgresql://db/shop",
            {"keepalives_interval": 2, "tcp_user_timeout": None},
            {
                k: v
                for k, v in DEFAULTS.items()
                if k not in ("keepalives_interval", "tcp_user_timeout")
            },
        ),
        # A service file may set them: an option given to libpq would win over it.
        ("service=shop", {}, {}),
        ("postgresql://db/shop?service=shop", {}, {}),
        ("host=db", {"service": "shop"}, {}),
    ],
)
def test_connections_get_the_tcp_defaults_the_user_does_not_set(
    dsn: str, connect_kwargs: dict[str, Any], added: dict[str, str]
) -> None:
    """A server gone without a RST (its host down, a network partition) held a statement, and
    the task thread's waits for it, for the kernel's TCP timeout (15 minutes and more)."""
    from snapline.sinks.postgres_connect import connect_arguments, tcp_defaults

    sink = PostgresSink(dsn, "totals", ["customer"], connect_kwargs=connect_kwargs)
    assert tcp_defaults(sink, environ={}) == added
    arguments = connect_arguments(sink, "snapline:job/orders-0")
    assert arguments == {
        "connect_timeout": 10,
        "application_name": "snapline:job/orders-0",
        **added,
        **connect_kwargs,
    }
    assert "FAKEPW" not in repr(arguments)  # the DSN's password stays in the DSN


def test_a_service_named_by_the_environment_gets_no_tcp_defaults() -> None:
    from snapline.sinks.postgres_connect import tcp_defaults

    sink = PostgresSink("postgresql://db/shop", "totals", ["customer"])
    assert tcp_defaults(sink, environ={"PGSERVICE": "shop"}) == {}
    assert tcp_defaults(sink, environ={"PGSERVICE": ""}) == DEFAULTS
