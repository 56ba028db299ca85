"""A Spark run from a savepoint refuses source-stage state it would restore while reading its
partitions' records again: the savepoint has no offsets of a source topic read now."""

from __future__ import annotations

import pytest

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.savepoint.format import OperatorState, SavepointFile, SavepointMetadata
from snapline.pipeline.spark.bounded import _check_source_state_placed


def _savepoint(topic: str, rows: int, partitioning: str = "source") -> SavepointMetadata:
    entry = SavepointFile("operators/dedup/p00000.parquet", rows, 10, "crc32:0", partition=0)
    op = OperatorState("dedup", partitioning, [], [entry])
    return SavepointMetadata("j", "x", 128, {topic: {0: 5}}, {topic: 1}, [op], [])


MAPPING = {("dedup", "seen"): object()}


def test_source_state_of_a_topic_read_no_more_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="no offsets of source topics src.orders"):
        _check_source_state_placed(_savepoint("orders", 3), MAPPING, ["src.orders"])


def test_the_same_topics_or_empty_or_keyed_state_pass() -> None:
    _check_source_state_placed(_savepoint("orders", 3), MAPPING, ["orders"])
    _check_source_state_placed(_savepoint("orders", 0), MAPPING, ["src.orders"])
    _check_source_state_placed(_savepoint("orders", 3, "keyed"), MAPPING, ["src.orders"])
    _check_source_state_placed(_savepoint("orders", 3), {}, ["src.orders"])
