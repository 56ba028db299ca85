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


class Visits(KeyedProcessFunction):  # 'count' (id 1) renamed 'visits', given a TTL
    visits = ValueState("visits", default=0, ttl=3600)

    def process(self, value: Any, ctx: Context) -> None:
        self.visits.update(self.visits.value() + 1)


class LongerVisits(KeyedProcessFunction):  # Visits with another TTL
    visits = ValueState("visits", default=0, ttl=7200)

    def process(self, value: Any, ctx: Context) -> None:
        self.visits.update(self.visits.value() + 1)


class Seen(KeyedProcessFunction):  # 'count' (id 1) replaced by a map state
    seen = MapState("seen")

    def process(self, value: Any, ctx: Context) -> None:
        self.seen.put(value["k"], True)


class Count(KeyedProcessFunction):
    count = ValueState("count", default=0)

    def process(self, value: Any, ctx: Context) -> None:
        self.count.update(self.count.value() + 1)


def _checkpoint_states(p: Pipeline) -> list[dict[str, Any]]:
    """The state descriptions a worker of ``p`` writes with its checkpoints."""
    uids = p.operator_uids()
    return [
        {**desc.describe(), "id": sid, "operator": node_id, "uid": uids[node_id]}
        for node_id, entries in p.state_ids().items()
        for sid, desc in entries
    ]


def continue_from_checkpoint(old: Pipeline, new: Pipeline) -> None:
    """The worker's check, running ``new``, of a checkpoint ``old`` wrote."""
    from types import SimpleNamespace

    from snapline.pipeline.checkpoint.metadata import CheckpointRef, TaskCheckpoint
    from snapline.pipeline.runtime.worker import Worker

    declared = {(d["uid"], d["name"]): d for d in _checkpoint_states(new)}
    worker = SimpleNamespace(pipeline=new, _declared_states=declared)
    meta = TaskCheckpoint(
        "job", "1-0", CheckpointRef(7, "a"), "w", {}, None, states=_checkpoint_states(old)
    )
    Worker._check_states(worker, "1-0", meta)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("function", "now"),
    [
        (Seen(), "'seen' of operator 'counter' (a map state, serde 'json', keys 'json')"),
        (Visits(), "'visits' of operator 'counter' (a value state, serde 'json', ttl=3600000 ms)"),
    ],
    ids=["map", "ttl"],
)
def test_a_state_renamed_or_replaced_at_its_id_is_refused(
    function: KeyedProcessFunction, now: str
) -> None:
    """Ids are positional: a state replaced in place keeps the old one's id, and read its
    entries as its own (with a TTL, every count read as an expiry in 1970 and deleted; a map
    state got orphan entries a savepoint exported under its name). Matching by name saw
    neither: the old name is no longer declared."""
    old = pipeline((Count(), "counter"))
    with pytest.raises(ConfigurationError) as refused:
        continue_from_checkpoint(old, pipeline((function, "counter")))
    message = str(refused.value)
    assert (
        "state id 1 holds 'count' of operator 'counter' (a value state, serde 'json') in "
        f"checkpoint 7 but is {now} in the code"
    ) in message
    assert "savepoint from-checkpoint" in message
    assert "--allow-non-restored-state" in message


def test_a_checkpoint_of_the_same_states_continues() -> None:
    """The same code; a TTL changed but kept; an operator given an explicit uid (its states
    keep their ids and names)."""
    continue_from_checkpoint(pipeline((Count(), "counter")), pipeline((Count(), "counter")))
    continue_from_checkpoint(pipeline((Visits(), "v")), pipeline((Visits(), "v")))
    continue_from_checkpoint(pipeline((Visits(), "v")), pipeline((LongerVisits(), "v")))
    continue_from_checkpoint(pipeline((Count(), None)), pipeline((Count(), "counter")))


def test_a_renamed_operator_keeps_its_states_at_their_ids_unless_they_changed() -> None:
    """Another uid, the same state name at the same id: the checks by name do not pair
    them, the one by id does."""
    from snapline.pipeline.state.compat import replaced_states

    stored = [{"id": 1, "uid": "old", "name": "total", "kind": "value", "serde": "json"}]
    renamed = {"id": 1, "uid": "new", "name": "total", "kind": "value", "serde": "json"}
    assert replaced_states(stored, {("new", "total"): renamed}, "checkpoint 7") == []
    as_pickle = {**renamed, "serde": "pickle"}
    assert replaced_states(stored, {("new", "total"): as_pickle}, "checkpoint 7") == [
        "state id 1 holds 'total' of operator 'old' (a value state, serde 'json') in "
        "checkpoint 7 but is 'total' of operator 'new' (a value state, serde 'pickle') in the "
        "code"
    ]
    # 'old' still names an operator of the code: its state went to another operator.
    timers = {"id": 2, "uid": "old", "name": "__timers__", "kind": "timers", "serde": "json"}
    code = {("new", "total"): renamed, ("old", "__timers__"): timers}
    assert len(replaced_states(stored, code, "checkpoint 7")) == 1


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
