"""``key_by()`` without a function on records whose Kafka key bytes are the key's bytes takes
them as they are: the key bytes and key-groups must equal the general path's (state written by
either path is found by the other, and savepoints do not depend on the path)."""

from __future__ import annotations

import zlib
from typing import Any

from snapline.pipeline.formats import decoder, encode_key
from snapline.pipeline.record import Record
from snapline.pipeline.runtime.operators import KeyByOperator, Operator

MAXP = 128


class _Task:
    def __init__(self) -> None:
        self.dead: list[tuple[Record, str]] = []

    def dead_letter(self, record: Record, reason: str, value: bytes | None = None) -> None:
        self.dead.append((record, reason))


class _Collect(Operator):
    def __init__(self) -> None:
        self.records: list[Record] = []

    def process(self, records: list[Record]) -> None:
        self.records.extend(records)


def _keyed(raw_keys: bool, key_format: str, raw_key_list: list[bytes | None]) -> list[Any]:
    decode = decoder(key_format)
    task = _Task()
    op = KeyByOperator(task, "key_by", None, MAXP, raw_keys=raw_keys)  # type: ignore[arg-type]
    op.owns_input = True
    out = _Collect()
    op.downstream.append(out)
    records = [
        Record({"n": i}, 0, "t", 0, i, decode(raw), raw, -1, b"{}", raw)
        for i, raw in enumerate(raw_key_list)
    ]
    op.process(records)
    return [(r.key, r.key_bytes, r.key_group) for r in out.records] + [
        reason for _, reason in task.dead
    ]


def test_string_keys_take_the_same_bytes_and_key_groups_as_the_general_path() -> None:
    keys = [b"c0001", "kund\u00e9".encode(), b"", b"x" * 300]
    fast = _keyed(True, "string", keys)
    general = _keyed(False, "string", keys)
    assert fast == general
    assert [kb for _, kb, _ in fast] == [encode_key(k.decode()) for k in keys]
    assert [g for _, _, g in fast] == [zlib.crc32(k) % MAXP for k in keys]


def test_bytes_keys_take_the_same_bytes_and_key_groups_as_the_general_path() -> None:
    keys = [b"\x00\xff", b"abc"]
    assert _keyed(True, "bytes", keys) == _keyed(False, "bytes", keys)


def test_a_record_without_key_is_a_dead_letter_on_both_paths() -> None:
    fast = _keyed(True, "string", [b"a", None])
    general = _keyed(False, "string", [b"a", None])
    assert fast[0] == general[0] and len(fast) == len(general) == 2
    assert isinstance(fast[1], str) and isinstance(general[1], str)


def test_keyless_records_leave_the_others_in_order() -> None:
    """The fast path passes its input list on as it is unless a record had no key: then the
    others go on in their order, without it."""
    keys = [b"a", None, b"b", None, b"c"]
    fast = _keyed(True, "string", keys)
    assert [kb for _, kb, _ in fast[:3]] == [b"a", b"b", b"c"]
    assert len(fast) == 5 and all("no key" in reason for reason in fast[3:])
    assert [kb for _, kb, _ in _keyed(True, "string", [b"a", b"b"])] == [b"a", b"b"]
