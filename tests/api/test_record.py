"""A Record handed to user code (a sink's ``write``, a process function) pickles and copies:
the source message it keeps for its dead letter's headers (a librdkafka message, which does
not pickle) is left out."""

from __future__ import annotations

import copy
import pickle
import threading

from snapline.pipeline.record import Record


def test_a_record_pickles_and_copies_without_its_source_message() -> None:
    unpicklable = threading.Lock()  # stands for confluent_kafka's Message
    record = Record({"a": 1}, 5, "orders", 2, 7, "k", b"k", 3, b"{}", b"k", unpicklable)
    for again in (pickle.loads(pickle.dumps(record)), copy.deepcopy(record), copy.copy(record)):
        assert again.message is None
        assert (again.value, again.timestamp, again.topic, again.partition, again.offset) == (
            {"a": 1},
            5,
            "orders",
            2,
            7,
        )
        assert (again.key, again.key_bytes, again.key_group, again.raw, again.raw_key) == (
            "k",
            b"k",
            3,
            b"{}",
            b"k",
        )
