"""The per-record paths of the keyed chain build what the general code would: the source
operators' records (made without ``Record.__init__``) hold every field, and the keyed process
operator's state keys (their header packed once per key-group and key length) are
``state_key_prefix(group, key bytes)`` plus the state id, whatever the mix of keys."""

from __future__ import annotations

import copy
import pickle
import struct
import zlib
from typing import Any

import orjson
import pytest

from snapline import KafkaSink, KafkaSource, KeyedProcessFunction, Pipeline, ValueState
from snapline.pipeline.functions import Context
from snapline.pipeline.keygroups import state_key_prefix
from snapline.pipeline.record import ListedMessage, Record
from snapline.pipeline.runtime.operators import (
    Operator,
    ProcessOperator,
    RepartitionSource,
    SourceOperator,
)
from snapline.pipeline.state import create_backend

MAXP = 128
#: Every field of a record (reading one a maker left unset raises AttributeError).
FIELDS: tuple[str, ...] = tuple(Record.__slots__)


class _Task:
    task_id = "0-0"
    epoch = 1
    watermark = -1

    def __init__(self) -> None:
        self.dead: list[tuple[Record, str]] = []

    def dead_letter(self, record: Record, reason: str, value: bytes | None = None) -> None:
        self.dead.append((record, reason))

    def now_ms(self) -> int:
        return 0

    def on_watermark_record(self, tp: Any, record: Any) -> None:
        pass


class _Collect(Operator):
    def __init__(self) -> None:
        self.records: list[Record] = []

    def process(self, records: list[Record]) -> None:
        self.records.extend(records)


def _fields(record: Record) -> tuple[Any, ...]:
    return tuple(getattr(record, name) for name in FIELDS)


def _collected(op: Operator) -> _Collect:
    out = _Collect()
    op.downstream.append(out)
    return out


def test_source_records_hold_every_field_as_the_constructor_sets_them() -> None:
    task = _Task()
    op = SourceOperator(task, "source", KafkaSource("in"))  # type: ignore[arg-type]
    out = _collected(op)
    messages = [
        ListedMessage("in", 3, 10, b'{"n": 1}', b"a", 5),
        ListedMessage("in", 3, 11, None, None, 6),
        ListedMessage("in", 3, 12, b"not json", b"b", 7),
        ListedMessage("in", 3, 13, b"[2]", "k\u00e9".encode(), 8),
    ]
    assert op.process_messages("in", 3, messages) == 8
    m = messages
    assert [_fields(r) for r in out.records] == [
        _fields(Record({"n": 1}, 5, "in", 3, 10, "a", b"a", -1, m[0].value(), b"a", m[0])),
        _fields(Record(None, 6, "in", 3, 11, None, None, -1, None, None, m[1])),
        _fields(Record([2], 8, "in", 3, 13, "k\u00e9", m[3].key(), -1, b"[2]", m[3].key(), m[3])),
    ]
    assert [r.offset for r, _ in task.dead] == [12]
    for record in out.records:
        assert isinstance(record, Record)
        for twin in (copy.copy(record), pickle.loads(pickle.dumps(record))):
            assert type(twin) is Record
            # All but the message (the last slot), which copies and pickles leave out.
            assert _fields(twin)[:-1] == _fields(record)[:-1] and twin.message is None
        assert type(record.with_value(1)) is Record


def test_repartition_records_hold_every_field_as_the_constructor_sets_them() -> None:
    op = RepartitionSource(_Task(), "by-customer", MAXP)  # type: ignore[arg-type]
    out = _collected(op)
    messages = [
        ListedMessage("rep", 1, 0, orjson.dumps({"n": 1}), b"sab", 5),
        ListedMessage("rep", 1, 1, orjson.dumps(2), b"b\x00\x01", -1),  # event time 0
    ]
    op.process_messages("rep", 1, messages)
    m = messages
    assert [_fields(r) for r in out.records] == [
        _fields(
            Record(
                {"n": 1}, 5, "rep", 1, 0, "ab", b"ab", zlib.crc32(b"ab") % MAXP,
                m[0].value(), b"sab", m[0],
            )
        ),
        _fields(
            Record(
                2, 0, "rep", 1, 1, b"\x00\x01", b"\x00\x01", zlib.crc32(b"\x00\x01") % MAXP,
                m[1].value(), b"b\x00\x01", m[1],
            )
        ),
    ]  # fmt: skip


class Count(KeyedProcessFunction):
    count: ValueState[int] = ValueState("count", default=0)

    def process(self, value: Any, ctx: Context) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield n


def _process_operator() -> tuple[ProcessOperator, Any, bytes]:
    pipeline = Pipeline("p")
    pipeline.source(KafkaSource("in")).key_by().process(Count()).sink(KafkaSink("out"))
    node = pipeline.nodes[2]
    [state_id] = [sid for sid, desc in pipeline.state_ids()[node.id] if desc is Count.count]
    backend = create_backend("memory")
    op = ProcessOperator(
        _Task(),  # type: ignore[arg-type]
        "count",
        node.fn,
        pipeline.state_ids()[node.id],
        backend,
        MAXP,
    )
    op.owns_input = True
    return op, backend, bytes([state_id])


def _keyed(key: bytes, offset: int) -> Record:
    return Record(None, 0, "in", 0, offset, key.decode(), key, zlib.crc32(key) % MAXP)


def test_state_keys_are_the_prefix_of_each_records_group_and_key_length() -> None:
    """Keys of one key-group with other lengths, and of other key-groups, in turns."""
    group = zlib.crc32(b"a") % MAXP
    same_group = [
        k for k in (f"{'x' * n}{i}".encode() for n in (1, 4, 9) for i in range(400))
        if zlib.crc32(k) % MAXP == group
    ]  # fmt: skip
    lengths = {len(k): k for k in same_group}
    assert len(lengths) >= 3
    keys = [b"a", *lengths.values(), b"b", b"a", b"zz", *lengths.values()]
    op, backend, sid = _process_operator()
    out = _collected(op)
    op.process([_keyed(k, i) for i, k in enumerate(keys)])
    counts: dict[bytes, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    assert [r.value for r in out.records][-len(lengths) :] == [2] * len(lengths)
    op.flush_state()
    stored = {k: v for k, _, v in backend.items()}
    assert stored == {
        state_key_prefix(zlib.crc32(k) % MAXP, k) + sid: str(n).encode() for k, n in counts.items()
    }


def test_a_record_without_a_key_group_gets_no_other_groups_prefix() -> None:
    op, _, _ = _process_operator()
    _collected(op)
    last = Record(None, 0, "in", 0, 0, "a", b"a", MAXP - 1)
    op.process([last])
    with pytest.raises(struct.error):
        op.process([Record(None, 0, "in", 0, 1, "b", b"b", -1)])
