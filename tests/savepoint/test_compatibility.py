"""Restoring a savepoint into changed code: matched by operator uid and state name; new state
and new operators start empty; state without a place is refused unless allowed; a kind or
serde change is refused naming the state. Also the format's checksums."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from snapline import (
    ConfigurationError,
    Context,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    ListState,
    MapState,
    Pipeline,
    ValueState,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CorruptCheckpointError
from snapline.pipeline.savepoint.format import (
    ENTRY_SCHEMA,
    OperatorState,
    SavepointMetadata,
    read_metadata,
    read_table,
    write_table,
)
from snapline.pipeline.savepoint.restore import match_states
from snapline.pipeline.state.compat import state_description


class Total(KeyedProcessFunction):
    total = ValueState("total", default=0)

    def process(self, value: Any, ctx: Context) -> None:
        self.total.update(self.total.value() + 1)


class TotalV2(KeyedProcessFunction):  # one added state
    total = ValueState("total", default=0)
    seen = ListState("seen")

    def process(self, value: Any, ctx: Context) -> None:
        self.total.update(self.total.value() + 1)


class TotalAsList(KeyedProcessFunction):  # the same name, another kind
    total = ListState("total")

    def process(self, value: Any, ctx: Context) -> None:
        self.total.add(value)


class Audit(KeyedProcessFunction):
    events = ListState("events")

    def process(self, value: Any, ctx: Context) -> None:
        self.events.add(value)


def pipeline(*functions: tuple[KeyedProcessFunction, str | None]) -> Pipeline:
    p = Pipeline("job")
    stream = p.source(KafkaSource("in", value_format="json")).key_by(lambda v: v["k"])
    for function, uid in functions:
        stream = stream.process(function, uid=uid)  # type: ignore[assignment]
    stream.sink(KafkaSink("out"))
    return p


def savepoint_of(p: Pipeline, legacy: bool = True) -> SavepointMetadata:
    """``legacy``: states described as savepoints did before TTLs and map key serdes were
    recorded (name, kind, serde); else as the export writes them now."""
    uids = p.operator_uids()
    operators = [
        OperatorState(
            uids[node_id],
            "keyed",
            [
                {k: d.describe()[k] for k in ("name", "kind", "serde")}
                if legacy
                else state_description(d.describe())
                for _, d in entries
            ],
            [],
        )
        for node_id, entries in p.state_ids().items()
    ]
    return SavepointMetadata("job", "0.1.0", 128, {}, {}, operators, [])


def test_an_upgrade_with_an_added_state_and_an_added_operator_restores() -> None:
    old = savepoint_of(pipeline((Total(), "total")))
    new = pipeline((TotalV2(), "total"), (Audit(), "audit"))
    mapping = match_states(new, old, allow_non_restored=False)
    # timers are one more keyed state of every keyed operator, restored like the others
    assert set(mapping) == {("total", "total"), ("total", "__timers__")}


def test_default_uids_are_stable_names() -> None:
    assert list(pipeline((Total(), None), (Total(), None)).operator_uids().values()) == [
        "Total",
        "Total-2",
    ]


def test_a_kind_change_is_refused_naming_the_state() -> None:
    old = savepoint_of(pipeline((Total(), "total")))
    with pytest.raises(ConfigurationError, match="state 'total' of operator 'total' is a value"):
        match_states(pipeline((TotalAsList(), "total")), old, allow_non_restored=False)


def Expiring(ttl: float | None, key_serde: str = "json") -> KeyedProcessFunction:  # noqa: N802
    """A function whose states are declared with ``ttl`` and map ``key_serde``."""

    class Function(KeyedProcessFunction):
        total = ValueState("total", default=0, ttl=ttl)
        seen = MapState("seen", key_serde=key_serde)

        def process(self, value: Any, ctx: Context) -> None:
            self.total.update(self.total.value() + 1)

    return Function()


def test_adding_or_removing_a_ttl_is_refused_changing_it_is_not() -> None:
    """A value of a state with a TTL is stored behind its expiry: restored into the same
    state without one, every read failed; restored with one added, every count read as
    expired in 1970 and was gone (an audit's repro). Savepoints did not record the TTL."""
    with_ttl = savepoint_of(pipeline((Expiring(3600), "total")), legacy=False)
    without = savepoint_of(pipeline((Expiring(None), "total")), legacy=False)
    with pytest.raises(ConfigurationError, match="has ttl=3600000 ms in the savepoint but no"):
        match_states(pipeline((Expiring(None), "total")), with_ttl, allow_non_restored=False)
    with pytest.raises(ConfigurationError, match="has no TTL in the savepoint but ttl=60000"):
        match_states(pipeline((Expiring(60), "total")), without, allow_non_restored=False)
    assert ("total", "total") in match_states(
        pipeline((Expiring(60), "total")), with_ttl, allow_non_restored=False
    )
    # A savepoint written before the TTL was recorded is not checked for it.
    legacy = savepoint_of(pipeline((Expiring(None), "total")))
    assert ("total", "total") in match_states(
        pipeline((Expiring(60), "total")), legacy, allow_non_restored=False
    )


def test_a_map_key_serde_change_is_refused() -> None:
    old = savepoint_of(pipeline((Expiring(None), "total")), legacy=False)
    with pytest.raises(ConfigurationError, match="map keys with serde 'json' in the savepoint"):
        match_states(
            pipeline((Expiring(None, key_serde="string"), "total")), old, allow_non_restored=False
        )


def test_state_without_a_place_is_refused_unless_allowed() -> None:
    old = savepoint_of(pipeline((Total(), "total"), (Audit(), "audit")))
    new = pipeline((Total(), "total"))
    with pytest.raises(ConfigurationError, match="--allow-non-restored-state"):
        match_states(new, old, allow_non_restored=False)
    assert set(match_states(new, old, allow_non_restored=True)) == {
        ("total", "total"),
        ("total", "__timers__"),
    }


def test_a_renamed_uid_loses_its_state_only_on_purpose() -> None:
    old = savepoint_of(pipeline((Total(), "total")))
    with pytest.raises(ConfigurationError, match="give the operator its old uid"):
        match_states(pipeline((Total(), "renamed")), old, allow_non_restored=False)


def test_files_and_metadata_are_checksummed(tmp_path: Any) -> None:
    storage = CheckpointStorage(str(tmp_path / "sp"))
    table = pa.table(
        {
            "key_group": [1],
            "key": [b"k"],
            "key_text": ["k"],
            "state": ["total"],
            "map_key": [None],
            "map_key_text": [None],
            "value": [b"3"],
            "value_json": ["3"],
        },
        schema=ENTRY_SCHEMA,
    )
    entry = write_table(storage, "operators/t/kg-00000-00127.parquet", table)
    assert read_table(storage, entry).to_pylist() == table.to_pylist()
    path = tmp_path / "sp" / entry.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        read_table(storage, entry)
    meta = SavepointMetadata("job", "0.1.0", 128, {"in": {0: 5}}, {"in": 1}, [], [])
    storage.write_bytes("_savepoint.json", meta.encode())
    assert read_metadata(storage).source_offsets == {"in": {0: 5}}
    raw = (tmp_path / "sp" / "_savepoint.json").read_bytes().replace(b'"in"', b'"ix"', 1)
    (tmp_path / "sp" / "_savepoint.json").write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        read_metadata(storage)


def _described(*states: tuple[str, str, int]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(uid, name): {"id": sid} for uid, name, sid in states}


def test_a_checkpoint_whose_state_ids_the_code_moved_is_named() -> None:
    """Entries are stored by state id, and ids are positional: the upgraded running total adds
    'largest' before 'total', whose id moves from 2 to 3."""
    from snapline.pipeline.state.compat import moved_states

    stored = [
        {"id": 1, "uid": "RunningTotal", "name": "count", "operator": 2},
        {"id": 2, "uid": "RunningTotal", "name": "total", "operator": 2},
    ]
    code = _described(
        ("RunningTotal", "count", 1), ("RunningTotal", "largest", 2), ("RunningTotal", "total", 3)
    )
    assert moved_states(stored, code, {2: "RunningTotal"}) == ["'total' of operator 'RunningTotal'"]


def test_unmoved_ids_pass_whatever_else_changed() -> None:
    """Same ids: an unchanged pipeline; a checkpoint of a version before operator uids (the
    operator's index names it); an operator given an explicit uid (its states are not
    compared: they keep their ids)."""
    from snapline.pipeline.state.compat import moved_states

    code = _described(("RunningTotal", "total", 1), ("RunningTotal", "__timers__", 2))
    current = [
        {"id": 1, "uid": "RunningTotal", "name": "total", "operator": 2},
        {"id": 2, "uid": "RunningTotal", "name": "__timers__", "operator": 2},
    ]
    before_uids = [
        {"id": 1, "name": "total", "operator": 2},
        {"id": 2, "name": "__timers__", "operator": 2},
    ]
    renamed = [{"id": 1, "uid": "old-name", "name": "total", "operator": 2}]
    for stored in (current, before_uids, renamed):
        assert moved_states(stored, code, {2: "RunningTotal"}) == []
