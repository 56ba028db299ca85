"""The handover benchmark's pure parts: per-partition output clock, --kafka-config parsing,
and the recovery benchmark's ratio to Quix Streams."""

from __future__ import annotations

import click
import orjson
import pytest

from benchmarks.__main__ import _kafka_settings
from benchmarks.handover import PartitionClock
from benchmarks.recovery import RecoveryResult, _ratios


def test_partition_clock_times_outputs_by_their_input_partition() -> None:
    clock = PartitionClock({"a": 0, "b": 1})
    clock(orjson.dumps({"customer": "a", "total": 1}), 10.0)
    clock(orjson.dumps({"customer": "b", "total": 1}), 11.0)
    clock(orjson.dumps({"customer": "a", "total": 2}), 20.0)
    clock(orjson.dumps({"customer": "zz", "total": 2}), 21.0)
    clock(b"not json", 22.0)
    assert clock.first_after(0, 5.0) == 10.0
    assert clock.first_after(0, 10.0) == 20.0  # strictly after
    assert clock.first_after(1, 11.0) is None
    assert clock.first_after(2, 0.0) is None
    assert clock.unknown == 1


def test_kafka_settings_parse_key_value_pairs() -> None:
    assert _kafka_settings(("transaction.timeout.ms=10000", " a = b ")) == {
        "transaction.timeout.ms": "10000",
        "a": "b",
    }
    with pytest.raises(click.BadParameter, match="KEY=VALUE"):
        _kafka_settings(("transaction.timeout.ms",))


def test_ratio_is_quix_changelog_p50_over_each_system_p50() -> None:
    results = [
        RecoveryResult("snapline-rocksdb", recovery_p50_s=2.0),
        RecoveryResult("quix-changelog", recovery_p50_s=30.0),
        RecoveryResult("snapline-memory", status="FAILED"),
    ]
    assert _ratios(results) == {"snapline-rocksdb": 15.0}
    assert _ratios(results[:1]) == {}
