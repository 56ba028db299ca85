"""PostgresSink against a real PostgreSQL (Debian's server, started by
snapline.connectors.local.postgres).

The sink is driven through the contract (write / pre_commit / commit / abort / recover) with
crashes simulated by abandoning writers, a database outage, and a writer process that is
SIGKILLed while SQL readers check that no row of an uncommitted checkpoint is ever visible.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql

from examples.workers import child_pythonpath
from snapline.connectors.local.postgres import LocalPostgres
from snapline.pipeline.errors import ConfigurationError, SinkError, SinkUnavailableError
from snapline.pipeline.record import Record
from snapline.pipeline.sink import SinkContext
from snapline.sinks import postgres as postgres_module
from snapline.sinks.postgres import PostgresSink, PostgresSinkWriter

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

REPO = Path(__file__).resolve().parent.parent
DeadLetters = list[tuple[Any, str, int]]


def make_table(dsn: str, name: str | None = None, extra: str = "") -> str:
    table = name or f"totals_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (customer text PRIMARY KEY, total numeric NOT NULL, "
                "n integer, note varchar(8){})"
            ).format(sql.Identifier(table), sql.SQL(extra))
        )
    return table


def open_writer(
    sink: PostgresSink, task: str = "orders-0", dead: DeadLetters | None = None
) -> PostgresSinkWriter:
    sink_dead = dead if dead is not None else []
    context = SinkContext(
        "pg-test",
        task,
        f"worker-{os.getpid()}",
        sink.name,
        None,  # type: ignore[arg-type]
        lambda r, reason, epoch: sink_dead.append((r.value, reason, epoch)),
    )
    return sink.open(context)


def write(writer: PostgresSinkWriter, rows: list[dict[str, Any]], epoch: int) -> None:
    writer.write_batch([Record(r, 0, "orders", 0, i) for i, r in enumerate(rows)], epoch)


def pre_commit(writer: PostgresSinkWriter, checkpoint: int) -> dict[str, Any]:
    result = writer.pre_commit(checkpoint)
    meta = result.result(timeout=60) if isinstance(result, Future) else result
    assert meta is not None
    return meta


def query(dsn: str, text: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(text, args or None).fetchall()  # type: ignore[arg-type]


def target(dsn: str, table: str) -> dict[str, tuple[Any, ...]]:
    rows = query(dsn, f'SELECT customer, total, n, _snapline_checkpoint FROM "{table}"')
    return {r[0]: (float(r[1]), r[2], r[3]) for r in rows}


def staged(dsn: str, table: str) -> int:
    return int(query(dsn, f'SELECT count(*) FROM "{table}__snapline_staging"')[0][0])


def staged_checkpoints(dsn: str, table: str) -> set[int]:
    rows = query(dsn, f'SELECT DISTINCT checkpoint_id FROM "{table}__snapline_staging"')
    return {int(r[0]) for r in rows}


# --------------------------------------------------------------------------- commit and fence


def test_staged_rows_are_invisible_until_commit(postgres_dsn: str) -> None:
    table = make_table(postgres_dsn)
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    writer.recover(None, None)
    write(
        writer,
        [
            {"customer": "a", "total": 1, "n": 1},
            {"customer": "b", "total": 2, "n": 1},
            {"customer": "a", "total": 3, "n": 2},
        ],
        1,
    )  # 'a' twice: the last one wins
    meta = pre_commit(writer, 1)
    assert meta["pending"][0]["checkpoint"] == 1 and meta["pending"][0]["rows"] == 3
    assert target(postgres_dsn, table) == {} and staged(postgres_dsn, table) == 3
    writer.commit(1)
    assert target(postgres_dsn, table) == {"a": (3.0, 2, 1), "b": (2.0, 1, 1)}
    assert staged(postgres_dsn, table) == 0
    writer.commit(1)  # re-running the commit is a no-op
    writer.recover(1, meta)
    assert target(postgres_dsn, table) == {"a": (3.0, 2, 1), "b": (2.0, 1, 1)}
    assert query(postgres_dsn, f'SELECT DISTINCT _snapline_task FROM "{table}"') == [
        ("pg-test/orders-0",)
    ]
    writer.close()


def test_a_replay_never_overwrites_newer_data(postgres_dsn: str) -> None:
    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    writer = open_writer(sink)
    writer.recover(None, None)
    write(writer, [{"customer": "a", "total": 1, "n": 1}], 1)
    meta1 = pre_commit(writer, 1)
    writer.commit(1)
    write(writer, [{"customer": "a", "total": 2, "n": 2}], 2)
    pre_commit(writer, 2)
    writer.commit(2)
    # Put checkpoint 1's rows back into staging, as a late replay would find them, and run
    # recovery of checkpoint 1 against them: the fence keeps checkpoint 2's value.
    token = meta1["pending"][0]["token"]
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} VALUES (%s, %s, 1, 0, %s)").format(
                sql.Identifier(f"{table}__snapline_staging")
            ),
            (
                writer.writer_key,
                token,
                orjson.dumps({"customer": "a", "total": 1, "n": 1}).decode(),
            ),
        )
    replay = open_writer(sink)
    replay.recover(1, meta1)
    assert target(postgres_dsn, table) == {"a": (2.0, 2, 2)}
    assert staged(postgres_dsn, table) == 0
    # A row from another task always wins: the key moved (rescaling), ids are per task.
    other = open_writer(sink, task="orders-7")
    other.recover(None, None)
    write(other, [{"customer": "a", "total": 9, "n": 9}], 1)
    pre_commit(other, 1)
    other.commit(1)
    assert target(postgres_dsn, table) == {"a": (9.0, 9, 1)}
    for w in (writer, replay, other):
        w.close()


def test_recovery_tells_the_highest_checkpoint_id_its_task_applied(postgres_dsn: str) -> None:
    """The upsert keeps a row its task wrote at a higher id. A job whose checkpoint storage was
    wiped or replaced numbers its checkpoints from 1 again, and its updates were dropped,
    silently: recovery now tells the worker the highest id the task applied (the worker's
    ids go on above it). A table an earlier version wrote gets it from its rows."""
    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    writer = open_writer(sink)
    writer.recover(None, None)
    assert writer.checkpoint_ids_above() is None
    write(writer, [{"customer": "a", "total": 1, "n": 1}], 500)
    pre_commit(writer, 500)
    writer.commit(500)
    write(writer, [{"customer": "b", "total": 2, "n": 1}], 501)
    pre_commit(writer, 501)
    writer.commit(501)
    writer.close()
    fresh = open_writer(sink)  # the same task after the storage was wiped: no checkpoint
    fresh.recover(None, None)
    assert fresh.checkpoint_ids_above() == 501
    other = open_writer(sink, task="orders-7")  # ids are per task
    other.recover(None, None)
    assert other.checkpoint_ids_above() is None
    for w in (fresh, other):
        w.close()
    # A table written before the tasks table existed: filled from the rows, once.
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(f"{table}__snapline_tasks")))
    upgraded = open_writer(sink)
    upgraded.recover(None, None)
    assert upgraded.checkpoint_ids_above() == 501
    upgraded.close()


def test_crash_after_the_commit_point_is_applied_by_recovery(postgres_dsn: str) -> None:
    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    crashed = open_writer(sink)
    crashed.recover(None, None)
    write(crashed, [{"customer": "a", "total": 1}], 1)
    meta1 = pre_commit(crashed, 1)
    write(crashed, [{"customer": "b", "total": 2}], 2)
    meta2 = pre_commit(crashed, 2)  # commit(1) never ran: metadata names 1 and 2
    assert [p["checkpoint"] for p in meta2["pending"]] == [1, 2]
    write(crashed, [{"customer": "c", "total": 3}], 3)
    pre_commit(crashed, 3)  # staged, but the commit point of 3 never came
    crashed.close()  # the process is gone
    successor = open_writer(sink)
    successor.recover(2, meta2)
    assert target(postgres_dsn, table) == {"a": (1.0, None, 1), "b": (2.0, None, 2)}
    # 3 is newer than the committed 2: a live owner could still commit it, so it stays
    # (never applied) until a checkpoint as high commits.
    assert staged(postgres_dsn, table) == 1
    again = open_writer(sink)
    again.recover(2, meta2)  # recovery itself is re-runnable
    assert len(target(postgres_dsn, table)) == 2
    assert meta1["pending"][0]["token"] == meta2["pending"][0]["token"]
    write(again, [{"customer": "d", "total": 4}], 3)
    pre_commit(again, 3)
    again.commit(3)
    assert set(target(postgres_dsn, table)) == {"a", "b", "d"}
    assert staged(postgres_dsn, table) == 0
    successor.close()
    again.close()


def test_zombie_staging_is_never_applied(postgres_dsn: str) -> None:
    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    zombie = open_writer(sink)
    zombie.recover(None, None)
    write(zombie, [{"customer": "a", "total": 1}], 1)
    meta1 = pre_commit(zombie, 1)
    zombie.commit(1)
    owner = open_writer(sink)
    owner.recover(1, meta1)
    write(zombie, [{"customer": "a", "total": 666}, {"customer": "z", "total": 666}], 2)
    write(zombie, [{"customer": "z", "total": 667}], 3)
    pre_commit(zombie, 3)  # the zombie stages 2 and 3 after the new owner recovered
    write(owner, [{"customer": "b", "total": 2}], 2)
    meta2 = pre_commit(owner, 2)
    owner.commit(2)
    assert target(postgres_dsn, table) == {"a": (1.0, None, 1), "b": (2.0, None, 2)}
    assert staged(postgres_dsn, table) == 3  # the zombie's epochs 2-3, staged as checkpoint 3
    later = open_writer(sink)
    later.recover(2, meta2)
    assert staged(postgres_dsn, table) == 3  # newer than 2: not provably dead yet
    write(later, [{"customer": "c", "total": 3}], 3)
    pre_commit(later, 3)
    later.commit(3)
    assert staged(postgres_dsn, table) == 0
    assert target(postgres_dsn, table) == {
        "a": (1.0, None, 1),
        "b": (2.0, None, 2),
        "c": (3.0, None, 3),
    }
    for w in (zombie, owner, later):
        w.close()


def test_zombie_recovery_with_stale_offsets_keeps_the_owners_rows(postgres_dsn: str) -> None:
    """Issue 9 item 1: a zombie re-runs recovery from checkpoint 1 (offsets read before the
    owner's commit of 2 landed) while the owner's rows of 2 are staged: they must survive
    and be applied when the owner's commit of 2 goes through."""
    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    first = open_writer(sink)
    first.recover(None, None)
    write(first, [{"customer": "a", "total": 1}], 1)
    meta1 = pre_commit(first, 1)
    first.commit(1)
    owner = open_writer(sink)
    owner.recover(1, meta1)
    write(owner, [{"customer": "b", "total": 2}], 2)
    pre_commit(owner, 2)
    zombie = open_writer(sink)
    zombie.recover(1, meta1)
    assert staged(postgres_dsn, table) == 1
    owner.commit(2)
    assert target(postgres_dsn, table) == {"a": (1.0, None, 1), "b": (2.0, None, 2)}
    for w in (first, owner, zombie):
        w.close()


def test_table_of_another_cluster_is_refused(postgres_dsn: str) -> None:
    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])

    def writer(cluster: str) -> PostgresSinkWriter:
        context = SinkContext(
            "pg-test",
            "orders-0",
            "w",
            sink.name,
            None,
            lambda *_: None,
            cluster,  # type: ignore[arg-type]
        )
        w = sink.open(context)
        w.recover(None, None)
        return w

    writer("cluster-a").close()
    writer("cluster-a").close()
    with pytest.raises(ConfigurationError, match="cluster cluster-a"):
        writer("cluster-b")


def test_abort_discards_staged_and_buffered_rows(postgres_dsn: str) -> None:
    table = make_table(postgres_dsn)
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    writer.recover(None, None)
    write(writer, [{"customer": "a", "total": 1}], 1)
    pre_commit(writer, 1)
    write(writer, [{"customer": "b", "total": 2}], 2)
    writer.abort(1)
    assert staged(postgres_dsn, table) == 0
    assert writer.pre_commit(2) == {"format": 1, "pending": []}
    write(writer, [{"customer": "c", "total": 3}], 3)
    pre_commit(writer, 3)
    writer.commit(3)
    assert set(target(postgres_dsn, table)) == {"c"}
    writer.close()


# --------------------------------------------------------------------------- bad rows


def test_rows_that_do_not_fit_are_dead_lettered_or_rejected(postgres_dsn: str) -> None:
    table = make_table(postgres_dsn, extra=", CHECK (n IS NULL OR n >= 0)")
    dead: DeadLetters = []
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]), dead=dead)
    writer.recover(None, None)
    rows = [
        {"customer": "ok", "total": 1, "n": 1},
        {"customer": "text-number", "total": "2.5", "n": "3"},
        {"total": 1},
        {"customer": "no-total"},
        {"customer": "bad-n", "total": 1, "n": "three"},
        {"customer": "long-note", "total": 1, "note": "123456789"},
        {"customer": "check-fails", "total": 1, "n": -5},  # only the database knows
        "not a dict",
    ]
    write(writer, rows, 4)
    pre_commit(writer, 4)
    writer.commit(4)
    assert set(target(postgres_dsn, table)) == {"ok", "text-number"}
    assert [(v, e) for v, _, e in dead] == [(rows[i], 4) for i in (2, 3, 4, 5, 7)]
    reasons = [reason for _, reason, _ in dead]
    assert "missing key column 'customer'" in reasons[0]
    assert "missing NOT NULL column 'total'" in reasons[1]
    assert "column 'n' (integer) expects an integer" in reasons[2]
    assert "more than 8" in reasons[3]
    rejected = query(postgres_dsn, f'SELECT row, sqlstate FROM "{table}__snapline_rejected"')
    assert [(r[0]["customer"], r[1]) for r in rejected] == [("check-fails", "23514")]
    assert writer.rows_rejected == 1
    writer.close()


def test_a_key_over_the_index_row_size_is_rejected_not_an_outage(postgres_dsn: str) -> None:
    """A key of ~3 KB of incompressible text is over the btree index row size: PostgreSQL
    raises 54000, an OperationalError, which was taken for a database down: the worker
    exited 75 and every restart applied the same row again. Now the row is rejected (kept in
    the rejected table) and the others are applied."""
    import random
    import string

    table = make_table(postgres_dsn)
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    writer.recover(None, None)
    huge = "".join(random.Random(7).choices(string.ascii_letters + string.digits, k=9000))
    write(writer, [{"customer": "ok", "total": 1}, {"customer": huge, "total": 2}], 1)
    pre_commit(writer, 1)
    writer.commit(1)
    assert set(target(postgres_dsn, table)) == {"ok"}
    rejected = query(postgres_dsn, f'SELECT sqlstate FROM "{table}__snapline_rejected"')
    assert rejected == [("54000",)]
    writer.close()


def test_a_large_checkpoint_with_one_refused_row_applies_every_other_row(
    postgres_dsn: str,
) -> None:
    """The row-by-row apply from its temporary copy of the checkpoint's rows (indexed by seq;
    each statement used to scan the whole checkpoint in staging) applies every other row and
    keeps the refused one. Its speed is not asserted here: measured by hand, 30,000 rows took
    87 s before and 10 s after (docs/sinks.md)."""
    table = make_table(postgres_dsn, extra=", CHECK (n IS NULL OR n >= 0)")
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    writer.recover(None, None)
    rows = [{"customer": f"c{i}", "total": i, "n": -1 if i == 2500 else i} for i in range(5000)]
    write(writer, rows, 1)
    pre_commit(writer, 1)
    writer.commit(1)
    applied = target(postgres_dsn, table)
    assert len(applied) == 4999 and "c2500" not in applied and applied["c4999"][0] == 4999.0
    rejected = query(postgres_dsn, f'SELECT row, sqlstate FROM "{table}__snapline_rejected"')
    assert [(r[0]["customer"], r[1]) for r in rejected] == [("c2500", "23514")]
    assert staged(postgres_dsn, table) == 0
    writer.close()


def test_configuration_errors_name_the_fix(postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS no_key (customer text, total numeric)")
    missing = open_writer(PostgresSink(postgres_dsn, "does_not_exist", ["k"]))
    with pytest.raises(ConfigurationError, match="does not exist.*CREATE TABLE"):
        missing.recover(None, None)
    no_key = open_writer(PostgresSink(postgres_dsn, "no_key", ["customer"]))
    with pytest.raises(ConfigurationError, match="ADD PRIMARY KEY"):
        no_key.recover(None, None)
    table = make_table(postgres_dsn)
    wrong_columns = open_writer(
        PostgresSink(postgres_dsn, table, ["customer"], columns=["customer", "nope"])
    )
    with pytest.raises(ConfigurationError, match="no columns \\['nope'\\]"):
        wrong_columns.recover(None, None)
    for w in (missing, no_key, wrong_columns):
        w.close()


def test_a_database_that_does_not_exist_is_a_refusal_not_an_outage(postgres_dsn: str) -> None:
    """The server answered and refused the DSN's database: restarts (exit 75, which a
    supervisor repeats without end) cannot fix that, so it is a SinkError (exit 1)."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    dsn = make_conninfo(**{**conninfo_to_dict(postgres_dsn), "dbname": "snapline_no_such_db"})
    writer = open_writer(PostgresSink(dsn, "totals", ["customer"]))
    with pytest.raises(SinkError, match="refused the connection.*does not exist") as raised:
        writer.recover(None, None)
    assert not isinstance(raised.value, SinkUnavailableError)
    assert "check the dsn's user, password, database and options" in str(raised.value)
    writer.close()


def test_non_ascii_rows_arrive_intact_in_a_latin1_database(postgres_dsn: str) -> None:
    """COPY writes UTF-8, and the session kept a LATIN1 database's encoding: "ä" was stored
    as "Ã¤", and with a non-ASCII sink name (the writer key) the apply matched no staged row
    and applied nothing, without an error."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    name = f"latin_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE DATABASE {} ENCODING 'LATIN1' TEMPLATE template0 LC_COLLATE 'C' "
                "LC_CTYPE 'C'"
            ).format(sql.Identifier(name))
        )
    dsn = make_conninfo(**{**conninfo_to_dict(postgres_dsn), "dbname": name})
    table = make_table(dsn)
    writer = open_writer(PostgresSink(dsn, table, ["customer"], name="postgres:umsätze"))
    writer.recover(None, None)
    write(writer, [{"customer": "käse", "total": 1, "n": 1}], 1)
    pre_commit(writer, 1)
    writer.commit(1)
    writer.close()
    assert target(dsn, table) == {"käse": (1.0, 1, 1)}
    assert staged(dsn, table) == 0


def test_a_bad_server_option_in_the_dsn_is_a_refusal_not_an_outage(postgres_dsn: str) -> None:
    """``options=-c statement_timeout=abc``: only the server checks it, and it refuses every
    connection (FATAL). That was taken for a database down: exit 75, restarted without end."""
    from psycopg.conninfo import make_conninfo

    table = make_table(postgres_dsn)
    dsn = make_conninfo(postgres_dsn, options="-c statement_timeout=abc")
    writer = open_writer(PostgresSink(dsn, table, ["customer"]))
    with pytest.raises(SinkError, match="refused the connection.*statement_timeout") as raised:
        writer.recover(None, None)
    assert not isinstance(raised.value, SinkUnavailableError)
    writer.close()


# --------------------------------------------------------------------------- timeouts

#: Seconds each statement writing the target sleeps in its trigger, far past TINY_TIMEOUT.
SLOW_APPLY = 0.2
#: The role's or DSN's statement_timeout and lock_timeout in the tests below, milliseconds.
TINY_TIMEOUT = 50


def slow_down_writes(dsn: str, table: str) -> None:
    """Every statement that writes ``table`` takes SLOW_APPLY s more (a statement trigger)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {} () RETURNS trigger LANGUAGE plpgsql AS "
                "'BEGIN PERFORM pg_sleep({}); RETURN NULL; END'"
            ).format(sql.Identifier(f"{table}_slow"), sql.Literal(SLOW_APPLY))
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER slow AFTER INSERT OR UPDATE ON {} FOR EACH STATEMENT "
                "EXECUTE FUNCTION {} ()"
            ).format(sql.Identifier(table), sql.Identifier(f"{table}_slow"))
        )


def timeout_dsn(
    postgres_dsn: str, table: str, how: str, settings: tuple[str, ...]
) -> tuple[str, Callable[[], None]]:
    """A DSN whose sessions have ``settings`` (statement_timeout, lock_timeout) of
    TINY_TIMEOUT ms, set in the DSN's options or on its role (which then owns ``table``); and
    a cleanup."""
    from psycopg.conninfo import make_conninfo

    if how == "dsn":
        options = " ".join(f"-c {setting}={TINY_TIMEOUT}" for setting in settings)
        return make_conninfo(postgres_dsn, options=options), lambda: None
    role = f"{table}_role"
    password = uuid.uuid4().hex
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        ident = sql.Identifier(role)
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(ident, sql.Literal(password))
        )
        for setting in settings:
            conn.execute(
                sql.SQL("ALTER ROLE {} SET {} = {}").format(
                    ident, sql.Identifier(setting), sql.Literal(f"{TINY_TIMEOUT}ms")
                )
            )
        conn.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(ident))
        conn.execute(sql.SQL("ALTER TABLE {} OWNER TO {}").format(sql.Identifier(table), ident))

    def drop_role() -> None:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))

    return make_conninfo(postgres_dsn, user=role, password=password), drop_role


@pytest.mark.parametrize("how", ["dsn", "role"])
def test_applies_that_outlast_the_statement_timeout_of_the_dsn_or_role_go_through(
    postgres_dsn: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every apply outlasts the role's (``ALTER ROLE ... SET statement_timeout``) or the DSN's
    (``options=-c statement_timeout=...``) statement_timeout. PostgreSQL canceled it (57014,
    an OperationalError), which was taken for a database down: the worker exited 75, and its
    restart applied the same checkpoint again, canceled again, without end. The sink's session
    now bounds its statements at SESSION_TIMEOUT (10 minutes): each checkpoint is applied, and
    a recovery too, exactly once."""
    table = make_table(postgres_dsn)
    dsn, cleanup = timeout_dsn(postgres_dsn, table, how, ("statement_timeout", "lock_timeout"))
    try:
        slow_down_writes(postgres_dsn, table)
        with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(%s)", (SLOW_APPLY,))  # the timeout is in force
        sink = PostgresSink(dsn, table, ["customer"])
        writer = open_writer(sink)
        with caplog.at_level("INFO", logger="snapline.sinks.postgres"):
            writer.recover(None, None)
        expected: dict[str, tuple[float, int | None, int]] = {}
        for checkpoint in (1, 2):
            rows = [
                {"customer": f"c{k}", "total": checkpoint * 100 + k}
                for k in range(0, 200, checkpoint)
            ]
            write(writer, rows, checkpoint)
            pre_commit(writer, checkpoint)
            writer.commit(checkpoint)  # raised SinkUnavailableError: statement timeout
            expected.update({r["customer"]: (float(r["total"]), None, checkpoint) for r in rows})
            assert target(postgres_dsn, table) == expected
        # Past its commit point, the writer is gone before commit(3): recovery applies it.
        write(writer, [{"customer": "c1", "total": 301}, {"customer": "new", "total": 1}], 3)
        meta3 = pre_commit(writer, 3)
        writer.close()
        recovered = open_writer(sink)
        recovered.recover(3, meta3)
        recovered.close()
        expected.update({"c1": (301.0, None, 3), "new": (1.0, None, 3)})
        assert target(postgres_dsn, table) == expected  # no loss, no duplicate, no stale value
        assert staged(postgres_dsn, table) == 0
        assert query(postgres_dsn, f'SELECT count(*) FROM "{table}__snapline_rejected"') == [(0,)]
        for setting in ("statement_timeout", "lock_timeout"):  # the sink says what it raised
            assert f"{setting} = {TINY_TIMEOUT}ms" in caplog.text
    finally:
        cleanup()


def test_an_apply_waits_for_a_lock_past_the_lock_timeout_of_the_dsn(postgres_dsn: str) -> None:
    """Someone holds a lock on the table a while longer than the DSN's lock_timeout. The
    apply's wait ended in 55P03 (an OperationalError), taken for a database down: the worker
    exited 75, and every restart applied the checkpoint again while the lock was held. The
    apply now waits for the lock (a lock held too long ends the worker at its liveness
    timeout, integration_tests/test_sink_lock.py, and its session's wait at SESSION_TIMEOUT)
    and goes through."""
    table = make_table(postgres_dsn)
    dsn, _ = timeout_dsn(postgres_dsn, table, "dsn", ("lock_timeout",))
    writer = open_writer(PostgresSink(dsn, table, ["customer"]))
    writer.recover(None, None)
    write(writer, [{"customer": "a", "total": 1}, {"customer": "b", "total": 2}], 1)
    pre_commit(writer, 1)
    locked = threading.Event()
    failures: list[BaseException] = []
    hold = 1.0  # seconds, twenty times the lock_timeout

    def locker() -> None:
        try:
            with psycopg.connect(postgres_dsn) as conn:
                conn.execute(sql.SQL("LOCK TABLE {} IN SHARE MODE").format(sql.Identifier(table)))
                locked.set()
                time.sleep(hold)
                conn.rollback()
        except BaseException as exc:
            failures.append(exc)
            locked.set()

    thread = threading.Thread(target=locker, name="locker")
    thread.start()
    try:
        assert locked.wait(30), "the locker did not lock the table in 30 s"
        start = time.monotonic()
        writer.commit(1)  # raised SinkUnavailableError: canceling statement due to lock timeout
        waited = time.monotonic() - start
    finally:
        thread.join(30)
    assert not failures and not thread.is_alive(), failures
    assert waited > hold / 2, f"the apply did not wait for the lock ({waited:.2f} s)"
    assert target(postgres_dsn, table) == {"a": (1.0, None, 1), "b": (2.0, None, 1)}
    assert staged(postgres_dsn, table) == 0
    writer.close()


def session_settings(writer: PostgresSinkWriter, names: tuple[str, ...]) -> dict[str, str]:
    """``SHOW`` of each of ``names`` the server has, on the writer's own connection."""

    def show() -> dict[str, str]:
        connection = writer._conn()
        found = connection.execute(
            "SELECT name FROM pg_settings WHERE name = ANY(%s)", (list(names),)
        ).fetchall()
        shown = {}
        for (name,) in found:
            row = connection.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            assert row is not None
            shown[name] = str(row[0])
        return shown

    return writer._call(show)


SESSION_SETTINGS = (
    "statement_timeout",
    "lock_timeout",
    "transaction_timeout",
    "client_connection_check_interval",
)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ("", ("10min", "10min", "10min", "10s")),
        # A role's or DSN's short timeout is raised to the sink's bound.
        (
            f"-c statement_timeout={TINY_TIMEOUT} -c lock_timeout={TINY_TIMEOUT}",
            ("10min",) * 3 + ("10s",),
        ),
        # A longer one, and a check interval, set in the DSN are kept.
        (
            "-c statement_timeout=2h -c lock_timeout=3h -c client_connection_check_interval=30s",
            ("2h", "3h", "10min", "30s"),
        ),
    ],
)
def test_the_sinks_session_bounds_its_statements_and_checks_its_client(
    postgres_dsn: str, options: str, expected: tuple[str, ...]
) -> None:
    """The sink's session set statement_timeout, lock_timeout and transaction_timeout to 0: a
    backend waiting for a lock (someone's ALTER TABLE, an idle transaction) stayed queued for
    as long as the lock was held, after its worker had exited 75 at its liveness timeout (or
    forever, with the watchdog off), one more at every restart, each holding a connection
    slot. Now they are finite, and the backend checks that its client is still there."""
    from psycopg.conninfo import make_conninfo

    table = make_table(postgres_dsn)
    dsn = make_conninfo(postgres_dsn, options=options) if options else postgres_dsn
    writer = open_writer(PostgresSink(dsn, table, ["customer"]))
    writer.recover(None, None)
    settings = session_settings(writer, SESSION_SETTINGS)
    writer.close()
    wanted = {n: e for n, e in zip(SESSION_SETTINGS, expected, strict=True) if n in settings}
    assert settings == wanted
    assert "statement_timeout" in settings and "client_connection_check_interval" in settings


def test_a_sink_session_waiting_for_a_lock_ends_once_its_client_is_gone(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose apply waits for a lock is ended by its liveness watchdog (exit 75). Its
    backend, waiting for the lock, did not read from the closed connection: it stayed in the
    lock's queue, holding a connection slot, until the lock was released (the session had no
    lock_timeout), and every restart left one more. Now it checks its client while it waits
    (client_connection_check_interval, 1 s here instead of 10 s) and ends."""
    monkeypatch.setattr(postgres_module, "CLIENT_CONNECTION_CHECK_INTERVAL", 1)
    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    writer = open_writer(sink)
    writer.recover(None, None)
    write(writer, [{"customer": "a", "total": 1}, {"customer": "b", "total": 2}], 1)
    meta = pre_commit(writer, 1)
    pid, fd = writer._call(lambda: (writer._conn().info.backend_pid, writer._conn().fileno()))

    def backend() -> list[tuple[Any, ...]]:
        return query(
            postgres_dsn, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", pid
        )

    failures: list[BaseException] = []

    def commit() -> None:
        try:
            writer.commit(1)
        except BaseException as exc:
            failures.append(exc)

    committer = threading.Thread(target=commit, name="committer")
    with psycopg.connect(postgres_dsn) as locker:
        locker.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(table))
        )
        committer.start()
        deadline = time.monotonic() + 30
        while backend() != [("Lock",)]:
            assert time.monotonic() < deadline, f"the apply did not wait for the lock: {backend()}"
            time.sleep(0.05)
        # The worker is gone (its watchdog's exit 75, a SIGKILL): its socket is closed.
        with socket.socket(fileno=os.dup(fd)) as gone:
            gone.shutdown(socket.SHUT_RDWR)
        start = time.monotonic()
        while backend() and time.monotonic() < start + 20:
            time.sleep(0.1)
        waited = time.monotonic() - start
        left = backend()  # while the lock is still held
        locker.rollback()
    committer.join(30)
    assert not left, f"the backend of a gone client still waits for the lock after {waited:.0f} s"
    assert len(failures) == 1 and isinstance(failures[0], SinkUnavailableError), failures
    writer.close()
    recovered = open_writer(sink)  # the restart applies the committed checkpoint
    recovered.recover(1, meta)
    recovered.close()
    assert target(postgres_dsn, table) == {"a": (1.0, None, 1), "b": (2.0, None, 1)}
    assert staged(postgres_dsn, table) == 0


def test_a_worker_whose_every_apply_outlasts_the_statement_timeout_does_not_loop(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """The warehouse job's worker writes through a DSN with a statement_timeout (and a
    lock_timeout) every apply outlasts. It exited 75 at its first commit, and each restart
    failed the same way, without end. Now it keeps running, and every order is in every
    sink exactly once (read_committed consumer, pyarrow on the table, SQL)."""
    # Here, not at the top: this file is also the SIGKILLed writer's script (writer_main).
    from integration_tests.warehouse_job import WarehouseJob, wait_for

    job = WarehouseJob(kafka_bootstrap, unique_name, tmp_path, postgres_dsn, workers=1)
    jobs.append(job)
    slow_down_writes(postgres_dsn, job.pg_table)
    dsn, _ = timeout_dsn(postgres_dsn, job.pg_table, "dsn", ("statement_timeout", "lock_timeout"))
    (worker,) = job.workers
    worker.start({"SNAPLINE_POSTGRES_DSN": dsn})
    job.produce(500)

    def applied_or_exited() -> bool:
        db = job.database()
        return not worker.alive or (
            {c: t for c, (t, _) in db.items()} == job.expected
            and sum(n for _, n in db.values()) == job.produced
        )

    wait_for("every order in PostgreSQL", applied_or_exited, 120, job.logs)
    assert worker.alive, f"the worker exited {worker.proc and worker.proc.returncode}\n{job.logs()}"
    job.produce(500)
    job.wait_until_caught_up()
    assert worker.stop() == 0, job.logs()
    # The worker's sessions had the timeouts (the sink raised them), and never exited 75.
    assert f"statement_timeout = {TINY_TIMEOUT}ms" in worker.log_path.read_text(), job.logs()
    job.verify()


# --------------------------------------------------------------------------- TCP keepalives

TCP_OPTIONS = (
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
#: The sink's defaults (TCP_DEFAULTS, docs/sinks.md): libpq's options, and the socket's.
TCP_DEFAULTS = dict(zip(TCP_OPTIONS, ("1", "20", "5", "4", "40000"), strict=True))


def tcp_settings(writer: PostgresSinkWriter) -> tuple[dict[str, str], dict[str, int]]:
    """The TCP options libpq has for the writer's live connection, and what the kernel has on
    its socket (what finds a server that is gone)."""

    def read() -> tuple[dict[str, str], dict[str, int]]:
        connection = writer._conn()
        libpq = {
            option.keyword.decode(): (option.val or b"").decode()
            for option in connection.pgconn.info
            if option.keyword.decode() in TCP_OPTIONS
        }
        with socket.socket(fileno=os.dup(connection.pgconn.socket)) as sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                pytest.fail(f"the sink's connection is not TCP ({sock.family!r}): use a TCP dsn")
            tcp = socket.IPPROTO_TCP
            kernel = {
                "keepalives": int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0),
                "keepalives_idle": sock.getsockopt(tcp, socket.TCP_KEEPIDLE),
                "keepalives_interval": sock.getsockopt(tcp, socket.TCP_KEEPINTVL),
                "keepalives_count": sock.getsockopt(tcp, socket.TCP_KEEPCNT),
                "tcp_user_timeout": sock.getsockopt(tcp, socket.TCP_USER_TIMEOUT),
            }
        return libpq, kernel

    return writer._call(read)


def system_keepalives() -> dict[str, int]:
    """The kernel's own keepalive settings, which a socket has unless libpq sets its own."""
    proc = Path("/proc/sys/net/ipv4")
    return {
        "keepalives_idle": int((proc / "tcp_keepalive_time").read_text()),
        "keepalives_interval": int((proc / "tcp_keepalive_intvl").read_text()),
        "keepalives_count": int((proc / "tcp_keepalive_probes").read_text()),
    }


@pytest.mark.parametrize(
    ("form", "options", "connect_kwargs", "libpq"),
    [
        ("uri", {}, {}, TCP_DEFAULTS),
        # The DSN's own win, as key=value settings or a URI's query.
        (
            "keywords",
            {"keepalives_idle": "7", "tcp_user_timeout": "12345"},
            {},
            {**TCP_DEFAULTS, "keepalives_idle": "7", "tcp_user_timeout": "12345"},
        ),
        (
            "uri",
            {"keepalives_interval": "3", "keepalives_count": "6"},
            {},
            {**TCP_DEFAULTS, "keepalives_interval": "3", "keepalives_count": "6"},
        ),
        # connect_kwargs win over the DSN; None leaves an option to libpq and the kernel.
        (
            "keywords",
            {"keepalives_idle": "7", "keepalives_count": "6"},
            {"keepalives_idle": 11, "tcp_user_timeout": None},
            {
                **TCP_DEFAULTS,
                "keepalives_idle": "11",
                "keepalives_count": "6",
                "tcp_user_timeout": "",
            },
        ),
        # Keepalives turned off: libpq ignores the other options, tcp_user_timeout too.
        ("uri", {"keepalives": "0"}, {}, {**TCP_DEFAULTS, "keepalives": "0"}),
    ],
)
def test_the_sinks_connections_find_a_server_that_is_gone(
    postgres_dsn: str,
    form: str,
    options: dict[str, str],
    connect_kwargs: dict[str, Any],
    libpq: dict[str, str],
) -> None:
    """A server that vanished without a RST (its host down, a network partition) held the
    writer's statement, and with it the task thread's waits (commit, recover, close), for
    the kernel's TCP timeout: 15 minutes and more with data in flight, 2 hours and more
    without. The sink's connections now have keepalives (20 s idle, 4 probes 5 s apart) and a
    40 s TCP user timeout, read back here from libpq and from the live socket, unless the DSN
    or connect_kwargs set their own."""
    # Never skipped: a machine where the socket options cannot be read fails, naming why.
    assert sys.platform.startswith("linux"), "reads Linux's TCP socket options: run on Linux"
    from urllib.parse import urlencode

    from psycopg.conninfo import make_conninfo

    dsn = postgres_dsn
    if options and form == "uri" and dsn.startswith(("postgresql://", "postgres://")):
        dsn = f"{dsn}{'&' if '?' in dsn else '?'}{urlencode(options)}"
    elif options:
        dsn = make_conninfo(dsn, **options)
    table = make_table(postgres_dsn)
    writer = open_writer(PostgresSink(dsn, table, ["customer"], connect_kwargs=connect_kwargs))
    writer.recover(None, None)
    got_libpq, kernel = tcp_settings(writer)
    writer.close()  # was: libpq's own (keepalives 1, the rest empty), the kernel's
    assert got_libpq == libpq
    on = libpq["keepalives"] != "0"
    expected = {
        "keepalives": int(on),
        **({name: int(libpq[name]) for name in system_keepalives()} if on else system_keepalives()),
        # libpq sets it with the keepalives only (fe-connect.c): keepalives=0 turns it off.
        "tcp_user_timeout": int(libpq["tcp_user_timeout"] or 0) if on else 0,
    }
    assert kernel == expected


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {},
            {
                "tcp_keepalives_idle": "20",
                "tcp_keepalives_interval": "5",
                "tcp_keepalives_count": "4",
                "tcp_user_timeout": "40000",
            },
        ),
        # A setting of the DSN's (as a role's or the server's would) is kept.
        (
            {"options": "-c tcp_keepalives_idle=7 -c tcp_user_timeout=12345"},
            {
                "tcp_keepalives_idle": "7",
                "tcp_keepalives_interval": "5",
                "tcp_keepalives_count": "4",
                "tcp_user_timeout": "12345",
            },
        ),
    ],
)
def test_the_server_finds_a_writer_host_that_is_gone(
    postgres_dsn: str, options: dict[str, str], expected: dict[str, str]
) -> None:
    """Found by review: the server's end of a writer's connection had the kernel's keepalive
    (2 hours), so a writer host gone without a FIN left its idle backend holding a connection
    slot that long, one more at each replacement. The server's socket options, as the
    backend reads them back (SHOW), now match the client's unless set elsewhere."""
    from psycopg.conninfo import make_conninfo

    dsn = make_conninfo(postgres_dsn, **options) if options else postgres_dsn
    writer = open_writer(PostgresSink(dsn, make_table(postgres_dsn), ["customer"]))
    writer.recover(None, None)

    def read() -> dict[str, str]:
        connection = writer._conn()
        assert connection.info.hostaddr, "a TCP connection is needed: use a TCP dsn"
        return {
            name: str(connection.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
            for name in expected
        }

    try:
        assert writer._call(read) == expected
    finally:
        writer.close()


def test_a_session_whose_setup_fails_is_closed(postgres_dsn: str) -> None:
    """Found by review: a connection whose session settings failed after it connected (a
    SET refused, the server gone in between) was neither kept nor closed, so each failed
    attempt left a session on the server for as long as anything referred to it. The
    failures below are kept, as a worker's log handler or a retry's traceback may keep them."""
    table = make_table(postgres_dsn)
    task = f"leak-{uuid.uuid4().hex[:8]}"
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]), task=task)
    failures: list[BaseException] = []

    def refuse(connection: Any) -> None:
        raise psycopg.errors.InsufficientPrivilege("permission denied to set parameter")

    writer._set_timeouts = refuse  # type: ignore[method-assign]
    for _ in range(3):
        try:
            writer._call(writer._conn)
        except psycopg.Error as exc:
            failures.append(exc)
    assert len(failures) == 3

    def sessions() -> int:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (f"snapline:{writer.task_key}"[:63],),
            ).fetchone()
        assert row is not None
        return int(row[0])

    deadline = time.monotonic() + 10  # a closed session leaves pg_stat_activity at once
    while sessions() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sessions() == 0, f"{sessions()} sessions left open by {len(failures)} failed setups"
    writer.close()


def test_a_connection_that_fails_never_shows_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A DSN with a password and TCP options of its own, to a port nothing listens on: an
    outage (exit 75), its message and the log without the password."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dsn = f"postgresql://app:FAKE-pw-x9q@127.0.0.1:{port}/shop?keepalives_idle=7"
    writer = open_writer(PostgresSink(dsn, "totals", ["customer"], connect_timeout=2))
    with caplog.at_level("DEBUG"), pytest.raises(SinkUnavailableError) as raised:
        writer.recover(None, None)
    writer.close()
    assert f"PostgreSQL at 127.0.0.1:{port}/shop" in str(raised.value)
    assert "pw-x9q" not in str(raised.value) and "pw-x9q" not in caplog.text


# --------------------------------------------------------------------------- many tasks


def test_tasks_write_one_table_concurrently(postgres_dsn: str) -> None:
    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    errors: list[BaseException] = []

    def task(index: int) -> None:
        try:
            writer = open_writer(sink, task=f"orders-{index}")
            writer.recover(None, None)
            for n in range(1, 6):
                rows = [
                    {"customer": f"t{index}-k{k}", "total": n * 100 + k, "n": n} for k in range(200)
                ]
                write(writer, rows, n)
                pre_commit(writer, n)
                writer.commit(n)
            writer.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    got = target(postgres_dsn, table)
    assert got == {f"t{i}-k{k}": (500.0 + k, 5, 5) for i in range(4) for k in range(200)}


# --------------------------------------------------------------------------- lock order, retries

#: Seconds an update of a row that another task wrote (or none) sleeps holding its lock.
HOLD = 1.0


def hold_row_locks(dsn: str, table: str) -> None:
    """Every update of a row of ``table`` that changes its task sleeps HOLD s (a row trigger)
    holding the row's lock: time for another writer to come and wait for it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {} () RETURNS trigger LANGUAGE plpgsql AS "
                "'BEGIN PERFORM pg_sleep({}); RETURN NEW; END'"
            ).format(sql.Identifier(f"{table}_hold"), sql.Literal(HOLD))
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER hold BEFORE UPDATE ON {} FOR EACH ROW "
                "WHEN (OLD._snapline_task IS DISTINCT FROM NEW._snapline_task) "
                "EXECUTE FUNCTION {} ()"
            ).format(sql.Identifier(table), sql.Identifier(f"{table}_hold"))
        )


def sleeping(dsn: str, task: str) -> bool:
    """Whether the session of the writer of ``task`` is sleeping in ``pg_sleep``."""
    rows = query(
        dsn,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
        "AND wait_event = 'PgSleep'",
        f"snapline:pg-test/{task}",
    )
    return bool(rows[0][0])


def test_writers_of_shared_keys_do_not_deadlock_when_one_applies_row_by_row(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two tasks write the same keys (a sink not fed by a key_by on the table's key). One
    checkpoint has a row the database refuses, so it is applied row by row, which locked its
    rows in seq order while the other task's bulk upsert locked them in key order: with the
    orders crossed, PostgreSQL aborted one apply (40P01, deadlock_detected), taken for a
    database down (SinkUnavailableError: the worker exited 75 and was restarted). Both passes
    now lock in key order: both commits go through, without a deadlock, each exactly once."""
    table = make_table(postgres_dsn, extra=", CHECK (n IS NULL OR n >= 0)")
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    writers = {task: open_writer(sink, task=task) for task in ("shared-0", "shared-1")}
    for writer in writers.values():
        writer.recover(None, None)  # connects, adds the fence columns the trigger reads
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} (customer, total) VALUES ('a', 0), ('z', 0)").format(
                sql.Identifier(table)
            )
        )
    hold_row_locks(postgres_dsn, table)
    rows = {
        # Its bulk upsert locks a (key order), then fails on 'bad'; row by row, in seq order,
        # it locked z, then waited for a, which the other writer had taken meanwhile.
        "shared-0": [
            {"customer": "z", "total": 1, "n": 1},
            {"customer": "a", "total": 2, "n": 1},
            {"customer": "bad", "total": 3, "n": -1},  # the CHECK refuses it
            {"customer": "z", "total": 4, "n": 2},  # the last write of a key wins
            {"customer": "only-0", "total": 5, "n": 1},
            {"customer": "a", "total": 6, "n": 2},
        ],
        "shared-1": [
            {"customer": "a", "total": 10, "n": 3},
            {"customer": "z", "total": 11, "n": 3},
            {"customer": "a", "total": 12, "n": 4},
            {"customer": "only-1", "total": 13, "n": 3},
        ],
    }
    for task, writer in writers.items():
        write(writer, rows[task], 1)
        pre_commit(writer, 1)
    failures: dict[str, BaseException] = {}

    def commit(task: str) -> None:
        try:
            writers[task].commit(1)
        except BaseException as exc:
            failures[task] = exc

    threads = {
        task: threading.Thread(target=commit, args=(task,), name=f"commit-{task}")
        for task in writers
    }
    with caplog.at_level("WARNING", logger="snapline.sinks.postgres"):
        threads["shared-0"].start()
        # The other writer starts once shared-0's bulk upsert holds a, so it waits for a.
        deadline = time.monotonic() + 30
        while not sleeping(postgres_dsn, "shared-0") and threads["shared-0"].is_alive():
            assert time.monotonic() < deadline, "shared-0 never held a row lock in 30 s"
            time.sleep(0.01)
        threads["shared-1"].start()
        for thread in threads.values():
            thread.join(60)
    assert not any(t.is_alive() for t in threads.values()), "a commit took more than 60 s"
    assert not failures, failures  # was: SinkUnavailableError ... deadlock detected
    # No deadlock at all: not one waited out by the sink's retries.
    assert "rolled back the apply" not in caplog.text, caplog.text
    # An independent read: each key once, a key's last write in the task that wrote it last.
    got = {
        r[0]: (float(r[1]), r[2], r[3], r[4])
        for r in query(
            postgres_dsn,
            f'SELECT customer, total, n, _snapline_checkpoint, _snapline_task FROM "{table}"',
        )
    }
    last = {
        "shared-0": {"a": (6.0, 2), "z": (4.0, 2), "only-0": (5.0, 1)},
        "shared-1": {"a": (12.0, 4), "z": (11.0, 3), "only-1": (13.0, 3)},
    }
    winner = str(got["a"][3]).removeprefix("pg-test/")
    assert winner in last and got["z"][3] == got["a"][3], got
    expected = {
        key: (*value, 1, f"pg-test/{task}")
        for task in ("shared-0", "shared-1")
        for key, value in last[task].items()
        if key not in ("a", "z") or task == winner
    }
    assert got == expected
    rejected = query(postgres_dsn, f'SELECT row, sqlstate FROM "{table}__snapline_rejected"')
    assert [(r[0]["customer"], r[1]) for r in rejected] == [("bad", "23514")]
    assert writers["shared-0"].rows_rejected == 1
    assert staged(postgres_dsn, table) == 0
    tasks = query(postgres_dsn, f'SELECT task, checkpoint FROM "{table}__snapline_tasks"')
    assert sorted(tasks) == [("pg-test/shared-0", 1), ("pg-test/shared-1", 1)]
    for writer in writers.values():
        writer.close()


@pytest.mark.parametrize("refused", ["a key it cannot read", "a CHECK"])
def test_row_by_row_applies_in_the_key_order_of_the_keys_type(
    postgres_dsn: str, refused: str
) -> None:
    """The row-by-row pass applies a checkpoint's rows in the bulk upsert's key order (an
    enum's order here, not its labels' text order), a key's rows in seq order (the last one
    wins); it did so in seq order. A key PostgreSQL cannot read (a label the enum does not
    have) makes it read the rows' keys one by one: that row is refused, the others keep the
    order."""
    table = f"sizes_{uuid.uuid4().hex[:10]}"
    kind = sql.Identifier(f"{table}_size")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TYPE {} AS ENUM ('small', 'medium', 'large')").format(kind))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (size {} PRIMARY KEY, total numeric NOT NULL CHECK (total >= 0))"
            ).format(sql.Identifier(table), kind)
        )
        # Which rows were applied, in which order (rolled back with a refused statement).
        conn.execute(
            sql.SQL("CREATE TABLE {} (n bigserial, size text, total numeric)").format(
                sql.Identifier(f"{table}_applied")
            )
        )
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {0} () RETURNS trigger LANGUAGE plpgsql AS 'BEGIN "
                "INSERT INTO {1} (size, total) VALUES (NEW.size, NEW.total); RETURN NULL; END'"
            ).format(sql.Identifier(f"{table}_log"), sql.Identifier(f"{table}_applied"))
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER log AFTER INSERT OR UPDATE ON {} FOR EACH ROW "
                "EXECUTE FUNCTION {} ()"
            ).format(sql.Identifier(table), sql.Identifier(f"{table}_log"))
        )
    writer = open_writer(PostgresSink(postgres_dsn, table, ["size"]))
    writer.recover(None, None)
    bad = {"size": "huge", "total": 3} if refused == "a key it cannot read" else None
    rows = [
        {"size": "large", "total": 1},
        {"size": "small", "total": 2},
        {"size": "medium", "total": 5},
        {"size": "small", "total": 4},
        bad or {"size": "medium", "total": -3},  # the last of its key: the bulk upsert fails
        {"size": "large", "total": 6},
    ]
    write(writer, rows, 1)
    pre_commit(writer, 1)
    writer.commit(1)
    applied = query(postgres_dsn, f'SELECT size, total FROM "{table}_applied" ORDER BY n')
    assert [(s, float(t)) for s, t in applied] == [
        ("small", 2.0),
        ("small", 4.0),
        ("medium", 5.0),
        ("large", 1.0),
        ("large", 6.0),
    ]
    final = query(postgres_dsn, f'SELECT size::text AS label, total FROM "{table}" ORDER BY size')
    assert [(s, float(t)) for s, t in final] == [("small", 4.0), ("medium", 5.0), ("large", 6.0)]
    rejected = query(postgres_dsn, f'SELECT row, sqlstate FROM "{table}__snapline_rejected"')
    assert [(r[0], r[1]) for r in rejected] == [(rows[4], "22P02" if bad else "23514")]
    assert staged(postgres_dsn, table) == 0
    writer.close()


def roll_back_writes(
    dsn: str, table: str, sqlstate: str, times: int, events: str = "INSERT OR UPDATE"
) -> Callable[[], int]:
    """The first ``times`` statements that write ``table`` (``events``: a COPY is an INSERT)
    raise ``sqlstate`` (a statement trigger; counted by a sequence, which a rollback does not
    undo), as PostgreSQL does for a deadlock (40P01) or a serialization failure (40001); and
    how many statements wrote."""
    sequence = sql.Identifier(f"{table}_writes")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SEQUENCE {}").format(sequence))
        body = (
            sql.SQL(
                "BEGIN IF nextval({}) <= {} THEN RAISE EXCEPTION 'rolled back by the test' "
                "USING ERRCODE = {}; END IF; RETURN NULL; END"
            )
            .format(
                sql.Literal(sequence.as_string(conn)), sql.Literal(times), sql.Literal(sqlstate)
            )
            .as_string(conn)
        )
        conn.execute(
            sql.SQL("CREATE FUNCTION {} () RETURNS trigger LANGUAGE plpgsql AS {}").format(
                sql.Identifier(f"{table}_roll_back"), sql.Literal(body)
            )
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER roll_back AFTER {} ON {} FOR EACH STATEMENT EXECUTE FUNCTION {} ()"
            ).format(sql.SQL(events), sql.Identifier(table), sql.Identifier(f"{table}_roll_back"))
        )

    def writes() -> int:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                sql.SQL("SELECT last_value, is_called FROM {}").format(sequence)
            ).fetchone()
        assert row is not None
        return int(row[0]) if row[1] else 0

    return writes


@pytest.mark.parametrize("sqlstate", ["40P01", "40001"])
def test_an_apply_rolled_back_for_a_deadlock_is_run_again(
    postgres_dsn: str, sqlstate: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL rolls the apply's transaction back twice for a deadlock (40P01) or a
    serialization failure (40001), in its row-by-row pass. That was taken for a database
    down: SinkUnavailableError, and the worker exited 75 and was restarted. The sink now runs
    the apply again (logging each retry) and it goes through, exactly once: the refused row
    is kept once, not once per attempt."""
    table = make_table(postgres_dsn, extra=", CHECK (n IS NULL OR n >= 0)")
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    writer.recover(None, None)
    writes = roll_back_writes(postgres_dsn, table, sqlstate, times=2)
    write(
        writer,
        [
            {"customer": "a", "total": 1, "n": 1},
            {"customer": "bad", "total": 2, "n": -1},  # refused: the row-by-row pass
            {"customer": "a", "total": 3, "n": 2},
            {"customer": "b", "total": 4, "n": 1},
        ],
        1,
    )
    pre_commit(writer, 1)
    with caplog.at_level("WARNING", logger="snapline.sinks.postgres"):
        writer.commit(1)  # raised SinkUnavailableError
    retries = [r.getMessage() for r in caplog.records if "rolled back the apply" in r.getMessage()]
    assert len(retries) == 2 and all(sqlstate in m for m in retries), retries
    assert "attempt 2 of 5" in retries[0] and "attempt 3 of 5" in retries[1]
    # Two rolled back, then a, a and b, each firing the INSERT and the UPDATE statement
    # triggers (ON CONFLICT DO UPDATE); bad's statement failed before they fire.
    assert writes() == 2 + 3 * 2
    assert target(postgres_dsn, table) == {"a": (3.0, 2, 1), "b": (4.0, 1, 1)}
    rejected = query(postgres_dsn, f'SELECT row, sqlstate FROM "{table}__snapline_rejected"')
    assert [(r[0]["customer"], r[1]) for r in rejected] == [("bad", "23514")]
    assert writer.rows_rejected == 1
    assert staged(postgres_dsn, table) == 0
    writer.close()


def test_an_apply_rolled_back_at_every_attempt_fails_as_before(postgres_dsn: str) -> None:
    """A deadlock at every attempt: after TRANSACTION_ATTEMPTS of them the commit fails as an
    outage (SinkUnavailableError: the worker exits 75), staged rows kept, nothing applied;
    the restarted worker's recovery applies the checkpoint, once."""
    from snapline.sinks.postgres import TRANSACTION_ATTEMPTS

    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    writer = open_writer(sink)
    writer.recover(None, None)
    writes = roll_back_writes(postgres_dsn, table, "40P01", times=1000)
    write(writer, [{"customer": "a", "total": 1}, {"customer": "b", "total": 2}], 1)
    meta = pre_commit(writer, 1)
    start = time.monotonic()
    with pytest.raises(
        SinkUnavailableError,
        match=rf"(?s)could not commit checkpoint 1 \({TRANSACTION_ATTEMPTS} attempts\) into "
        r".*rolled back by the test.*\(the checkpoint fails and is retried; staged rows are kept\)",
    ):
        writer.commit(1)
    assert time.monotonic() - start < 10, "the retries were not short"
    assert writes() == TRANSACTION_ATTEMPTS
    assert target(postgres_dsn, table) == {} and staged(postgres_dsn, table) == 2
    writer.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TRIGGER roll_back ON {}").format(sql.Identifier(table)))
    recovered = open_writer(sink)
    recovered.recover(1, meta)
    assert target(postgres_dsn, table) == {"a": (1.0, None, 1), "b": (2.0, None, 1)}
    assert staged(postgres_dsn, table) == 0
    recovered.close()


@pytest.mark.parametrize("sqlstate", ["40P01", "40001"])
def test_a_staging_rolled_back_for_a_deadlock_is_run_again(
    postgres_dsn: str, sqlstate: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL rolls the staging's transaction back twice (its COPY) for a deadlock or a
    serialization failure: the checkpoint failed as an outage. The sink runs the whole
    transaction again, and its rows are staged once, not once per attempt."""
    table = make_table(postgres_dsn)
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    writer.recover(None, None)
    writes = roll_back_writes(postgres_dsn, f"{table}__snapline_staging", sqlstate, 2, "INSERT")
    write(writer, [{"customer": "a", "total": 1}, {"customer": "b", "total": 2}], 1)
    with caplog.at_level("WARNING", logger="snapline.sinks.postgres"):
        meta = pre_commit(writer, 1)  # raised SinkUnavailableError
    assert meta["pending"] == [{"checkpoint": 1, "token": writer.token, "rows": 2}]
    retries = [
        r.getMessage() for r in caplog.records if "rolled back the staging" in r.getMessage()
    ]
    assert len(retries) == 2 and all(sqlstate in m for m in retries), retries
    assert writes() == 3 and staged(postgres_dsn, table) == 2
    writer.commit(1)
    assert target(postgres_dsn, table) == {"a": (1.0, None, 1), "b": (2.0, None, 1)}
    assert staged(postgres_dsn, table) == 0
    writer.close()


def test_a_staging_rolled_back_at_every_attempt_fails_as_before(postgres_dsn: str) -> None:
    """After TRANSACTION_ATTEMPTS rolled-back stagings the checkpoint fails as an outage
    (SinkUnavailableError), nothing staged; its epochs, replayed, are staged and applied once."""
    from snapline.sinks.postgres import TRANSACTION_ATTEMPTS

    table = make_table(postgres_dsn)
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    writer.recover(None, None)
    staging = f"{table}__snapline_staging"
    writes = roll_back_writes(postgres_dsn, staging, "40P01", times=1000, events="INSERT")
    rows = [{"customer": "a", "total": 1}, {"customer": "b", "total": 2}]
    write(writer, rows, 1)
    start = time.monotonic()
    with pytest.raises(
        SinkUnavailableError,
        match=rf"(?s)could not stage checkpoint 1 \({TRANSACTION_ATTEMPTS} attempts\) into "
        r".*rolled back by the test",
    ):
        pre_commit(writer, 1)
    assert time.monotonic() - start < 10, "the retries were not short"
    assert writes() == TRANSACTION_ATTEMPTS and staged(postgres_dsn, table) == 0
    writer.abort(1)  # the runtime's, for the failed checkpoint; it replays the epochs
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TRIGGER roll_back ON {}").format(sql.Identifier(staging)))
    write(writer, rows, 2)
    pre_commit(writer, 2)
    writer.commit(2)
    assert target(postgres_dsn, table) == {"a": (1.0, None, 2), "b": (2.0, None, 2)}
    assert staged(postgres_dsn, table) == 0
    writer.close()


def stage_dead_rows(dsn: str, table: str, sink: PostgresSink) -> None:
    """A writer stages checkpoints 1 (customer a) and 2 (b), then is gone: no committed
    checkpoint names its rows, dead once a checkpoint ≥ 2 committed."""
    zombie = open_writer(sink)
    zombie.recover(None, None)
    write(zombie, [{"customer": "a", "total": 1}], 1)
    pre_commit(zombie, 1)
    write(zombie, [{"customer": "b", "total": 2}], 2)
    pre_commit(zombie, 2)
    zombie.close()
    assert staged_checkpoints(dsn, table) == {1, 2}


def test_a_deadlock_in_the_deletion_of_dead_staged_rows_is_run_again(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A real deadlock: recovery's deletion of a task's dead staged rows locks checkpoint 1's
    row, then waits for checkpoint 2's, which another session holds while it waits for
    checkpoint 1's. PostgreSQL aborts the deletion (40P01): that failed the recovery as an
    outage (the worker exited 75). The sink deletes them again once the other session is
    done; nothing dead is ever applied."""
    if not query(postgres_dsn, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")[0][0]:
        pytest.fail(
            "this test sets deadlock_timeout (which picks the deadlock's victim), a superuser's "
            "setting: run it against the tests' own server or give SNAPLINE_POSTGRES_DSN a "
            "superuser role"
        )
    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    stage_dead_rows(postgres_dsn, table, sink)
    staging = sql.Identifier(f"{table}__snapline_staging")
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        # Checkpoint 1's row stays locked by its deletion HOLD s (a BEFORE DELETE row trigger
        # runs once the row is locked): time for the other session to come and wait for it.
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {} () RETURNS trigger LANGUAGE plpgsql AS "
                "'BEGIN PERFORM pg_sleep({}); RETURN OLD; END'"
            ).format(sql.Identifier(f"{table}_hold"), sql.Literal(HOLD))
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER hold BEFORE DELETE ON {} FOR EACH ROW "
                "WHEN (OLD.checkpoint_id = 1) EXECUTE FUNCTION {} ()"
            ).format(staging, sql.Identifier(f"{table}_hold"))
        )
    lock = sql.SQL("SELECT 1 FROM {} WHERE checkpoint_id = %s FOR UPDATE").format(staging)
    recovered = open_writer(sink)
    failures: list[BaseException] = []

    def recover() -> None:
        try:
            recovered.recover(2, {"format": 1, "pending": []})
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=recover, name="recover")
    with psycopg.connect(postgres_dsn) as other, caplog.at_level("WARNING"):
        # Its wait is never the one PostgreSQL ends (the sink's deadlock check, after the
        # server's 1 s, finds the cycle first), and is bounded anyway.
        other.execute("SET deadlock_timeout = '60s'")
        other.execute("SET lock_timeout = '30s'")
        other.execute(lock, (2,))
        thread.start()
        deadline = time.monotonic() + 30
        while not sleeping(postgres_dsn, "orders-0") and thread.is_alive():
            assert time.monotonic() < deadline, "the deletion never held a row lock in 30 s"
            time.sleep(0.01)
        other.execute(lock, (1,))  # granted once PostgreSQL aborted the deletion
        other.commit()
        thread.join(60)
    assert not thread.is_alive(), "the recovery took more than 60 s"
    assert not failures, failures  # was: SinkUnavailableError ... deadlock detected
    retries = [
        r.getMessage() for r in caplog.records if "rolled back the deletion" in r.getMessage()
    ]
    assert len(retries) == 1 and "40P01: deadlock detected" in retries[0], retries
    assert staged(postgres_dsn, table) == 0 and target(postgres_dsn, table) == {}
    recovered.close()


def test_a_deletion_rolled_back_at_every_attempt_fails_as_before(postgres_dsn: str) -> None:
    """After TRANSACTION_ATTEMPTS rolled-back deletions the recovery fails as an outage
    (SinkUnavailableError: the worker exits 75), the rows kept; the next recovery deletes them."""
    from snapline.sinks.postgres import TRANSACTION_ATTEMPTS

    table = make_table(postgres_dsn)
    sink = PostgresSink(postgres_dsn, table, ["customer"])
    stage_dead_rows(postgres_dsn, table, sink)
    staging = f"{table}__snapline_staging"
    writes = roll_back_writes(postgres_dsn, staging, "40P01", times=1000, events="DELETE")
    recovered = open_writer(sink)
    with pytest.raises(
        SinkUnavailableError,
        match=rf"(?s)could not delete staged rows \({TRANSACTION_ATTEMPTS} attempts\) in .*rolled "
        r"back by the test",
    ):
        recovered.recover(2, {"format": 1, "pending": []})
    assert writes() == TRANSACTION_ATTEMPTS and staged_checkpoints(postgres_dsn, table) == {1, 2}
    recovered.close()
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TRIGGER roll_back ON {}").format(sql.Identifier(staging)))
    restarted = open_writer(sink)
    restarted.recover(2, {"format": 1, "pending": []})
    assert staged(postgres_dsn, table) == 0 and target(postgres_dsn, table) == {}
    restarted.close()


def require_superuser(dsn: str) -> None:
    """Fail (never skip) where the tests' role cannot set deadlock_timeout, which picks a
    deadlock's victim: a superuser's setting."""
    if not query(dsn, "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")[0][0]:
        pytest.fail(
            "this test sets deadlock_timeout (which picks the deadlock's victim), a superuser's "
            "setting: run it against the tests' own server or give SNAPLINE_POSTGRES_DSN a "
            "superuser role"
        )


def await_lock_wait(
    dsn: str, event: str, alive: Callable[[], bool], pid: int | None = None
) -> bool:
    """Whether the session of ``pid`` (else the writer of task orders-0) came to wait for a
    lock of kind ``event`` (``relation``, ``transactionid``) while ``alive()``; at most 30 s."""
    with psycopg.connect(dsn, autocommit=True) as monitor:
        deadline = time.monotonic() + 30
        while alive():
            row = monitor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND wait_event = %s AND (pid = %s OR (%s::int IS NULL AND application_name "
                "= 'snapline:pg-test/orders-0'))",
                (event, pid, pid),
            ).fetchone()
            if row is not None and row[0]:
                return True
            assert time.monotonic() < deadline, f"no session waited for a {event} lock in 30 s"
            time.sleep(0.005)
    return False


def recovering(writer: PostgresSinkWriter, *args: Any) -> tuple[threading.Thread, list[Any]]:
    """A thread (not started) that runs ``writer.recover(*args)``; and what it raised."""
    failures: list[BaseException] = []

    def recover() -> None:
        try:
            writer.recover(*args)
        except BaseException as exc:
            failures.append(exc)

    return threading.Thread(target=recover, name="recover"), failures


def retries_of(caplog: pytest.LogCaptureFixture, step: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"rolled back {step}" in r.getMessage()]


def lands_exactly_once(dsn: str, table: str, writer: PostgresSinkWriter, checkpoint: int) -> None:
    """The writer's next checkpoint is applied, each row once, nothing left staged or refused."""
    rows = [{"customer": "a", "total": 1, "n": 1}, {"customer": "b", "total": 2, "n": 2}]
    write(writer, rows, checkpoint)
    pre_commit(writer, checkpoint)
    writer.commit(checkpoint)
    assert target(dsn, table) == {"a": (1.0, 1, checkpoint), "b": (2.0, 2, checkpoint)}
    assert query(dsn, f'SELECT count(*) FROM "{table}"')[0][0] == 2
    assert staged(dsn, table) == 0
    assert query(dsn, f'SELECT count(*) FROM "{table}__snapline_rejected"')[0][0] == 0


def test_a_setup_that_loses_the_race_to_create_a_table_is_run_again(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another session (a migration) creates the sink's rejected table while the first setup
    of the table runs: the setup's CREATE TABLE IF NOT EXISTS waits for it and, once it
    committed, fails on pg_type's unique index (23505), which IF NOT EXISTS does not cover.
    That was a SinkError: the worker crashed (exit 1). The setup runs again, and finds the
    table."""
    table = make_table(postgres_dsn)
    spec = postgres_module.TableSpec("public", table, (), ("customer",))
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    thread, failures = recovering(writer, None, None)
    with psycopg.connect(postgres_dsn) as migration, caplog.at_level("WARNING"):
        migration.execute(postgres_module.rejected_ddl(spec))
        thread.start()
        assert await_lock_wait(postgres_dsn, "transactionid", thread.is_alive), failures
        migration.commit()
        thread.join(60)
    assert not thread.is_alive(), "the setup took more than 60 s"
    assert not failures, failures  # was: SinkError ... "pg_type_typname_nsp_index"
    retries = retries_of(caplog, "the setup of the sink's tables")
    assert len(retries) == 1 and "23505" in retries[0] and "pg_type" in retries[0], retries
    assert "attempt 2 of 5" in retries[0]
    lands_exactly_once(postgres_dsn, table, writer, 1)
    writer.close()


def test_a_deadlock_in_the_setup_of_a_table_is_run_again(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A real deadlock in the first setup of a table: the setup holds the table's lock (its
    ALTER TABLE adds the fence columns) and waits for a migration creating the sink's rejected
    table, which waits to read the table. PostgreSQL aborts the setup (40P01): the worker's
    first write (or its recovery) failed as an outage (exit 75). The setup runs again once the
    migration is done, and the rows land once."""
    require_superuser(postgres_dsn)
    table = make_table(postgres_dsn)
    spec = postgres_module.TableSpec("public", table, (), ("customer",))
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    thread, failures = recovering(writer, None, None)
    read_failures: list[BaseException] = []
    with (
        psycopg.connect(postgres_dsn) as holder,
        psycopg.connect(postgres_dsn) as migration,
        caplog.at_level("WARNING"),
    ):
        # The setup waits first for the holder's staging table (uncommitted), holding the
        # table's lock: time for the migration to come and wait for that lock. Once the holder
        # is gone, the setup comes to wait for the migration: the setup's wait closes the
        # cycle, so its deadlock check (after the server's 1 s) is the one that finds it.
        holder.execute(postgres_module.staging_ddl(spec)[0])
        migration.execute("SET deadlock_timeout = '60s'")
        migration.execute("SET lock_timeout = '30s'")
        migration.execute(postgres_module.rejected_ddl(spec))
        thread.start()
        assert await_lock_wait(postgres_dsn, "transactionid", thread.is_alive), failures

        def read_the_table() -> None:
            try:
                migration.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table)))
                migration.commit()
            except BaseException as exc:
                read_failures.append(exc)

        reader = threading.Thread(target=read_the_table, name="migration")
        reader.start()
        pid = migration.info.backend_pid
        assert await_lock_wait(postgres_dsn, "relation", reader.is_alive, pid), read_failures
        holder.rollback()
        reader.join(60)
        thread.join(60)
    assert not thread.is_alive() and not reader.is_alive(), "the setup took more than 60 s"
    assert not read_failures, read_failures
    assert not failures, failures  # was: SinkUnavailableError ... deadlock detected
    retries = retries_of(caplog, "the setup of the sink's tables")
    assert len(retries) == 1 and "40P01: deadlock detected" in retries[0], retries
    lands_exactly_once(postgres_dsn, table, writer, 1)
    writer.close()


def test_a_deadlock_in_the_read_of_the_applied_checkpoint_ids_is_run_again(
    postgres_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A real deadlock in recovery's read of the highest checkpoint id its task applied: a
    maintenance session REINDEXes the tasks table's primary key (locking the index) and goes
    on to lock the table (ALTER TABLE, LOCK TABLE), while the read holds the table and waits
    for the index. PostgreSQL aborts the read (40P01): the recovery failed as an outage (exit
    75). The sink reads again, and its task goes on above the id it had applied: the replayed
    checkpoint lands once."""
    require_superuser(postgres_dsn)
    table = make_table(postgres_dsn)
    # The read waits first; a deadlock check of 2 s leaves the maintenance session time to
    # come and close the cycle (a superuser's setting: require_superuser).
    dsn = f"{postgres_dsn}{'&' if '?' in postgres_dsn else '?'}options=-c%20deadlock_timeout%3D2s"
    sink = PostgresSink(dsn, table, ["customer"])
    first = open_writer(sink)
    first.recover(None, None)
    for checkpoint, rows in enumerate(
        ([{"customer": "a", "total": 9, "n": 9}], [{"customer": "c", "total": 3, "n": 3}]), 1
    ):
        write(first, rows, checkpoint)
        pre_commit(first, checkpoint)
        first.commit(checkpoint)
    write(first, [{"customer": "b", "total": 7, "n": 7}], 3)
    pre_commit(first, 3)  # staged; the worker dies before checkpoint 3's commit point
    first.close()
    (index,) = query(
        postgres_dsn,
        "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = %s::regclass",
        f'"{table}__snapline_tasks"',
    )[0]
    recovered = open_writer(sink)
    thread, failures = recovering(recovered, 2, {"format": 1, "pending": []})
    with psycopg.connect(postgres_dsn) as maintenance, caplog.at_level("WARNING"):
        maintenance.execute("SET deadlock_timeout = '60s'")
        maintenance.execute("SET lock_timeout = '30s'")
        maintenance.execute(sql.SQL("REINDEX INDEX {}").format(sql.SQL(index)))
        thread.start()
        assert await_lock_wait(postgres_dsn, "relation", thread.is_alive), failures
        maintenance.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
                sql.Identifier(f"{table}__snapline_tasks")
            )
        )  # granted once PostgreSQL aborted the read
        maintenance.commit()
        thread.join(60)
    assert not thread.is_alive(), "the recovery took more than 60 s"
    assert not failures, failures  # was: SinkUnavailableError ... deadlock detected
    retries = retries_of(caplog, "the read of the applied checkpoint ids")
    assert len(retries) == 1 and "40P01: deadlock detected" in retries[0], retries
    assert recovered.checkpoint_ids_above() == 2
    # The replay of checkpoint 3 (its rows were staged under the dead writer's token, which
    # no committed checkpoint names): applied once, the dead writer's rows deleted.
    write(recovered, [{"customer": "b", "total": 7, "n": 7}], 3)
    pre_commit(recovered, 3)
    recovered.commit(3)
    assert target(postgres_dsn, table) == {
        "a": (9.0, 9, 1),
        "b": (7.0, 7, 3),
        "c": (3.0, 3, 2),
    }
    assert query(postgres_dsn, f'SELECT count(*) FROM "{table}"')[0][0] == 3
    assert staged(postgres_dsn, table) == 0
    recovered.close()


# --------------------------------------------------------------------------- outage


def test_database_outage_fails_the_checkpoint_and_loses_nothing(
    own_postgres: LocalPostgres,
) -> None:
    dsn = own_postgres.dsn
    table = make_table(dsn)
    sink = PostgresSink(dsn, table, ["customer"], connect_timeout=2)
    writer = open_writer(sink)
    writer.recover(None, None)
    write(writer, [{"customer": "a", "total": 1}], 1)
    meta1 = pre_commit(writer, 1)
    writer.commit(1)

    # Down at pre-commit: the checkpoint fails; the runtime aborts and replays epoch 2.
    write(writer, [{"customer": "b", "total": 2}], 2)
    own_postgres.stop(keep_data=True)
    with pytest.raises(SinkUnavailableError, match="could not stage checkpoint 2.*retried"):
        pre_commit(writer, 2)
    writer.abort(2)
    own_postgres.start()
    writer.close()
    writer = open_writer(sink)
    writer.recover(1, meta1)
    write(writer, [{"customer": "b", "total": 2}], 2)
    meta2 = pre_commit(writer, 2)
    writer.commit(2)

    # Down at commit (after the commit point): commit raises; recovery applies it later.
    write(writer, [{"customer": "c", "total": 3}], 3)
    meta3 = pre_commit(writer, 3)
    own_postgres.stop(keep_data=True)
    with pytest.raises(SinkUnavailableError, match="could not commit checkpoint 3"):
        writer.commit(3)
    own_postgres.start()
    writer.close()
    recovered = open_writer(sink)
    recovered.recover(3, meta3)
    assert target(dsn, table) == {"a": (1.0, None, 1), "b": (2.0, None, 2), "c": (3.0, None, 3)}
    assert staged(dsn, table) == 0
    assert meta2["pending"][0]["checkpoint"] == 2
    recovered.close()


# --------------------------------------------------------------------------- SIGKILL


KEYS = 120


def _aborted(checkpoint: int) -> bool:
    return checkpoint % 4 == 3


def _writes(checkpoint: int, key: int) -> bool:
    return (key + checkpoint) % 3 != 0


def _value(checkpoint: int, key: int) -> int:
    return checkpoint * 1000 + key


def epoch_rows(checkpoint: int) -> list[dict[str, Any]]:
    rows = []
    for key in range(KEYS):
        if _writes(checkpoint, key):
            # A wrong value first: only the last write of a key in the epoch may survive.
            rows.append({"customer": f"k{key}", "total": -1, "n": checkpoint})
            rows.append({"customer": f"k{key}", "total": _value(checkpoint, key), "n": checkpoint})
    return rows


def expected_state(committed: int | None) -> dict[str, tuple[float, int, int]]:
    state: dict[str, tuple[float, int, int]] = {}
    for checkpoint in range(1, (committed or 0) + 1):
        if _aborted(checkpoint):
            continue
        for key in range(KEYS):
            if _writes(checkpoint, key):
                state[f"k{key}"] = (float(_value(checkpoint, key)), checkpoint, checkpoint)
    return state


def _commit_point(state: Path) -> tuple[int | None, dict[str, Any] | None]:
    try:
        body = orjson.loads((state / "committed.json").read_bytes())
    except FileNotFoundError:
        return None, None
    return int(body["checkpoint"]), body["metadata"]


def writer_main(dsn: str, table: str, state_dir: str, seed: str) -> None:
    """A worker stand-in: recovers from its commit point, then checkpoints forever."""
    state = Path(state_dir)
    rng = random.Random(seed)
    writer = open_writer(PostgresSink(dsn, table, ["customer"]))
    committed, meta = _commit_point(state)
    writer.recover(committed, meta)
    checkpoint = (committed or 0) + 1
    while True:
        write(writer, epoch_rows(checkpoint), checkpoint)
        meta = pre_commit(writer, checkpoint)
        if _aborted(checkpoint):
            writer.abort(checkpoint)
        else:
            tmp = state / f"committed.{os.getpid()}.tmp"
            tmp.write_bytes(orjson.dumps({"checkpoint": checkpoint, "metadata": meta}))
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, state / "committed.json")  # ◀── commit point
            writer.commit(checkpoint)
        checkpoint += 1
        time.sleep(rng.uniform(0, 0.02))


def test_sigkilled_writer_under_concurrent_sql_readers(postgres_dsn: str, tmp_path: Path) -> None:
    table = make_table(postgres_dsn)
    setup = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    setup.recover(None, None)  # adds the fence columns the readers select
    setup.close()
    state = tmp_path / "state"
    state.mkdir()
    stop = threading.Event()
    failures: list[BaseException] = []
    reads: list[int] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                rows = target(postgres_dsn, table)
                committed, _ = _commit_point(state)  # read after the query
                for customer, (total, n, checkpoint) in rows.items():
                    assert checkpoint is not None and checkpoint <= (committed or 0), (
                        f"{customer} shows checkpoint {checkpoint}, committed {committed}"
                    )
                    assert not _aborted(checkpoint)
                    assert (total, n) == (float(_value(checkpoint, int(customer[1:]))), checkpoint)
                reads.append(len(rows))
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=reader, name="sql-reader")
    thread.start()
    rng = random.Random(7)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for round_number in range(4):
            with open(tmp_path / f"writer-{round_number}.log", "wb") as log:
                process = subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "writer",
                        postgres_dsn,
                        table,
                        str(state),
                        str(round_number),
                    ],
                    env={**os.environ, "PYTHONPATH": child_pythonpath()},
                    stderr=log,
                )
            processes.append(process)
            # Kill only after this writer committed something of its own (a loaded machine
            # can take seconds to start Python), at a random moment after that.
            before, _ = _commit_point(state)
            deadline = time.monotonic() + 120
            while _commit_point(state)[0] == before and time.monotonic() < deadline:
                assert process.poll() is None, (tmp_path / f"writer-{round_number}.log").read_text()
                time.sleep(0.05)
            assert _commit_point(state)[0] != before, "the writer committed nothing in 120 s"
            time.sleep(rng.uniform(0.2, 1.5))
            assert process.poll() is None, (tmp_path / f"writer-{round_number}.log").read_text()
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(60)
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    if failures:
        raise failures[0]
    committed, meta = _commit_point(state)
    assert committed is not None and committed > 4
    final = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    final.recover(committed, meta)
    assert target(postgres_dsn, table) == expected_state(committed)  # no loss, no duplicate
    # The last writer may have died between staging checkpoint committed + 1 and its commit
    # point: those rows are not provably dead (a live owner could still commit them), so
    # recovery keeps them, and nothing at or below the commit point may remain.
    left = staged_checkpoints(postgres_dsn, table)
    assert all(checkpoint > committed for checkpoint in left), (committed, left)
    # The recovered writer's next committed checkpoint removes them.
    checkpoint = committed + 1 if not _aborted(committed + 1) else committed + 2
    write(final, epoch_rows(checkpoint), checkpoint)
    pre_commit(final, checkpoint)
    final.commit(checkpoint)
    assert target(postgres_dsn, table) == expected_state(checkpoint)
    assert staged(postgres_dsn, table) == 0
    assert len(reads) >= 10
    final.close()


# --------------------------------------------------------------------------- throughput


def test_throughput(postgres_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    table = make_table(postgres_dsn)
    writer = open_writer(PostgresSink(postgres_dsn, table, ["customer"]))
    writer.recover(None, None)
    checkpoints, per_checkpoint = 10, 5000
    timings = {"write": 0.0, "pre_commit": 0.0, "commit": 0.0}
    clock: Callable[[], float] = time.perf_counter
    for n in range(1, checkpoints + 1):
        rows = [
            {"customer": f"c{(n * per_checkpoint + i) % 20000}", "total": i * 0.5, "n": n}
            for i in range(per_checkpoint)
        ]
        records = [Record(r, 0, "orders", 0, i) for i, r in enumerate(rows)]
        start = clock()
        writer.write_batch(records, n)
        staged_at = clock()
        pre_commit(writer, n)
        committed_at = clock()
        writer.commit(n)
        done = clock()
        timings["write"] += staged_at - start
        timings["pre_commit"] += committed_at - staged_at
        timings["commit"] += done - committed_at
    total_rows = checkpoints * per_checkpoint
    rates = {k: total_rows / v for k, v in timings.items()}
    overall = total_rows / sum(timings.values())
    with capsys.disabled():
        print(
            f"\nPostgresSink {total_rows} rows: "
            + ", ".join(f"{k} {v:,.0f} rows/s" for k, v in rates.items())
            + f", overall {overall:,.0f} rows/s"
        )
    assert len(target(postgres_dsn, table)) == 20000
    assert overall > 500  # a floor that only a broken sink misses, even on a loaded machine
    writer.close()


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "writer":
    writer_main(*sys.argv[2:])
