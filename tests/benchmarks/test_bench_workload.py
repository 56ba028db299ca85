"""The benchmark input: record size, determinism and the expected effect."""

from __future__ import annotations

import orjson

from benchmarks.workload import Expected, each_key_once, encode_record, generate, order_key


def test_records_are_100_bytes_of_json() -> None:
    for amount in (1, 17, 100):
        raw = encode_record("c0000123", amount, 1790000000123)
        assert len(raw) == 100
        assert orjson.loads(raw)["amount"] == amount


def test_order_keyed_records_carry_the_order_id_and_keep_the_size() -> None:
    raw = encode_record("c0000123", 17, 1790000000123, order=order_key(42))
    assert len(raw) == 100
    value = orjson.loads(raw)
    assert value["order"] == "o000000042"
    assert (value["customer"], value["amount"]) == ("c0000123", 17)


def test_random_filler_keeps_the_size() -> None:
    raw = encode_record("c0000123", 5, 1790000000123, 194, filler="ab" * 200)
    assert len(raw) == 194
    assert "x" not in orjson.loads(raw)["note"]


def test_generate_is_deterministic_and_bounded() -> None:
    first = list(generate(1000, 50))
    assert first == list(generate(1000, 50))
    assert {c for c, _, _ in first} <= {f"c{i:07d}" for i in range(50)}
    assert all(1 <= a <= 100 for _, a, _ in first)


def test_each_key_once() -> None:
    keys = [c for c, _, _ in each_key_once(300)]
    assert len(keys) == len(set(keys)) == 300


def test_expected_effect() -> None:
    exp = Expected()
    for key, amount in [("a", 1), ("b", 2), ("a", 3)]:
        exp.add(key, amount)
    assert exp.totals == {"a": 4, "b": 2}
    assert exp.counts == {"a": 2, "b": 1}
    assert exp.sum_of_totals == 1 + 2 + 4
    assert exp.count == 3 and exp.amount_sum == 6
