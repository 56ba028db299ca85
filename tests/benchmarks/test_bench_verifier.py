"""The verifier's accounting: a correct run passes, every kind of wrong output is caught."""

from __future__ import annotations

import orjson

from benchmarks.verifier import Tally, check, produce_span_rate
from benchmarks.workload import Expected, LatencyLedger

INPUTS = [("a", 3), ("b", 5), ("a", 4), ("c", 1), ("b", 2)]


def expected() -> Expected:
    exp = Expected()
    for key, amount in INPUTS:
        exp.add(key, amount)
    return exp


def outputs() -> list[bytes]:
    totals: dict[str, int] = {}
    out = []
    for key, amount in INPUTS:
        totals[key] = totals.get(key, 0) + amount
        out.append(orjson.dumps({"customer": key, "total": totals[key]}))
    return out


def tally_of(values: list[bytes], mode: str = "total") -> Tally:
    tally = Tally(mode)  # type: ignore[arg-type]
    for raw in values:
        tally.observe(raw, 0.0)
    return tally


def test_correct_output_passes() -> None:
    assert check(tally_of(outputs()), expected(), exactly_once=True) == []


def rolling(values: list[bytes]) -> list[bytes]:
    """The same outputs as a rolling aggregate emits them."""
    out = []
    for raw in values:
        v = orjson.loads(raw)
        out.append(orjson.dumps({"key": v["customer"], "value": v["total"]}))
    return out


def test_rolling_outputs_are_checked_like_totals() -> None:
    assert check(tally_of(rolling(outputs()), "rolling"), expected(), exactly_once=True) == []
    out = outputs()
    duplicated = rolling([*out[:3], out[2], *out[3:]])
    problems = check(tally_of(duplicated, "rolling"), expected(), exactly_once=True)
    assert any("6 outputs for 5 inputs" in p for p in problems)
    wrong = rolling([*out[:4], orjson.dumps({"customer": "b", "total": 8})])
    assert check(tally_of(wrong, "rolling"), expected(), exactly_once=True)
    # Read as plain totals they are not understood at all.
    assert tally_of(rolling(outputs())).undecodable == len(INPUTS)


def test_duplicate_is_caught_under_exactly_once_only() -> None:
    out = outputs()
    duplicated = [*out[:3], out[2], *out[3:]]
    problems = check(tally_of(duplicated), expected(), exactly_once=True)
    assert any("6 outputs for 5 inputs" in p for p in problems)
    assert check(tally_of(duplicated), expected(), exactly_once=False) == []


def test_lost_output_is_caught() -> None:
    out = outputs()
    problems = check(tally_of(out[:1] + out[2:]), expected(), exactly_once=True)
    assert any("4 outputs for 5 inputs" in p for p in problems)


def test_lost_plus_duplicate_keeps_count_but_is_caught() -> None:
    out = outputs()
    # a's first output lost, b's last output duplicated: same count, same final totals
    swapped = [out[1], out[2], out[3], out[4], out[4]]
    problems = check(tally_of(swapped), expected(), exactly_once=True)
    assert problems


def test_wrong_total_is_caught() -> None:
    out = outputs()
    out[-1] = orjson.dumps({"customer": "b", "total": 8})
    problems = check(tally_of(out), expected(), exactly_once=True)
    assert any("wrong total" in p for p in problems)


def test_garbage_is_caught() -> None:
    problems = check(tally_of([*outputs()[:-1], b"not json"]), expected(), exactly_once=True)
    assert any("not the expected JSON" in p for p in problems)


def test_map_mode_checks_amounts() -> None:
    good = [orjson.dumps({"customer": k, "amount": a}) for k, a in INPUTS]
    assert check(tally_of(good, "map"), expected(), exactly_once=True) == []
    bad = [*good[:-1], orjson.dumps({"customer": "b", "amount": 3})]
    assert check(tally_of(bad, "map"), expected(), exactly_once=True)


def test_latency_matches_the_nth_output_of_a_key_to_its_nth_input() -> None:
    ledger = LatencyLedger()
    ledger.record("a", 1, 100.0)  # warm-up
    ledger.start_measuring()
    ledger._warmup_done_at = 200.0  # deterministic for the test
    ledger.record("a", 2, 200.0)
    ledger.record("b", 5, 201.0)
    tally = Tally("total")
    tally.observe(orjson.dumps({"customer": "a", "total": 1}), 150.0, ledger)
    tally.observe(orjson.dumps({"customer": "b", "total": 5}), 201.5, ledger)
    tally.observe(orjson.dumps({"customer": "a", "total": 3}), 202.0, ledger)
    assert sorted(tally.latencies) == [0.5, 2.0]
    assert tally.unmatched == 0
    tally.observe(orjson.dumps({"customer": "b", "total": 9}), 203.0, ledger)
    assert tally.unmatched == 1


def unordered_expected() -> Expected:
    exp = Expected(ordered=False)
    for key, amount in INPUTS:
        exp.add(key, amount)
    return exp


def test_unordered_input_accepts_any_per_key_merge_order() -> None:
    # Input keyed by order id: a's 4 may be processed before its 3 (totals 4, 7, not 3, 7).
    merged = [
        orjson.dumps({"customer": k, "total": t})
        for k, t in [("a", 4), ("b", 5), ("a", 7), ("c", 1), ("b", 7)]
    ]
    assert check(tally_of(merged), expected(), exactly_once=True)  # ordered: wrong
    assert check(tally_of(merged), unordered_expected(), exactly_once=True) == []


def test_unordered_input_catches_a_lost_output_hidden_by_a_duplicate() -> None:
    # a's first output lost and its last one replayed: count, per-key counts and final totals
    # are right.
    merged = [
        orjson.dumps({"customer": k, "total": t})
        for k, t in [("b", 5), ("a", 7), ("c", 1), ("b", 7), ("a", 7)]
    ]
    problems = check(tally_of(merged), unordered_expected(), exactly_once=True)
    assert problems


def test_unordered_squares_catch_a_lost_step_with_right_final_total() -> None:
    exp = Expected(ordered=False)
    for key, amount in [("a", 3), ("a", 4), ("a", 5)]:
        exp.add(key, amount)
    # three increasing outputs ending at 12 either way: steps 3, 5, 4 are the amounts in
    # another order; steps 2, 5, 5 are not
    good = [orjson.dumps({"customer": "a", "total": t}) for t in (3, 8, 12)]
    bad = [orjson.dumps({"customer": "a", "total": t}) for t in (2, 7, 12)]
    assert check(tally_of(good), exp, exactly_once=True) == []
    assert any("squared steps" in p for p in check(tally_of(bad), exp, exactly_once=True))


def test_the_produce_span_rate_leaves_out_the_start_and_the_wait_for_the_last_commit() -> None:
    """1,001 outputs produced from 10.5 s to 14.5 s (wall clock), the run timed from 10.0 s
    (first input) to 15.4 s (last output visible after the last commit)."""
    assert produce_span_rate(1001, 10_500, 14_500, started=10.0, seen=15.4) == 250.0
    assert 1001 / (15.4 - 10.0) < 190  # what N / (last output seen - start) says
    # Stamps that cannot be the system's produce times: its input's, copied (Quix Streams).
    assert produce_span_rate(1001, 2_000, 6_000, started=10.0, seen=15.4) is None
    assert produce_span_rate(1001, 10_500, 19_000, started=10.0, seen=15.4) is None
    assert produce_span_rate(1001, None, None, started=10.0, seen=15.4) is None
    assert produce_span_rate(1, 10_500, 10_500, started=10.0, seen=15.4) is None
