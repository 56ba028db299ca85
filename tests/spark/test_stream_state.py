"""The state mapping of ``snapline spark stream``: Snapline's five state types on Spark's state
variables (MapState on a Spark MapState, the others on a Spark ValueState each), driven
through the keyed processor as Spark's transformWithState drives it, with a small in-memory
stand-in for Spark's state handle (the real one runs in integration_tests/test_spark_stream.py).
"""

from __future__ import annotations

import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
from pyspark.sql import Row

from snapline import (
    AggregateFunction,
    AggregatingState,
    Context,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    ListState,
    MapState,
    Pipeline,
    ReducingState,
    ValueState,
)
from snapline.pipeline.formats import tag_key
from snapline.pipeline.spark.stream_ops import keyed_processor, spark_state_name


class Mean(AggregateFunction[int, list[int], float]):
    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, value: int, accumulator: list[int]) -> list[int]:
        return [accumulator[0] + value, accumulator[1] + 1]

    def get_result(self, accumulator: list[int]) -> float:
        return accumulator[0] / accumulator[1]


class Everything(KeyedProcessFunction):
    count = ValueState("count", default=0)
    amounts = ListState("amounts")
    by_item = MapState("by_item")
    largest = ReducingState("largest", reduce_fn=max)
    mean = AggregatingState("mean", aggregate=Mean())

    def process(self, value: dict[str, Any], ctx: Context) -> Any:
        self.count.update(self.count.value() + 1)
        self.amounts.add(value["amount"])
        self.by_item.put(value["item"], self.by_item.get(value["item"], 0) + 1)
        self.largest.add(value["amount"])
        self.mean.add(value["amount"])
        yield {
            "key": ctx.key,
            "offset": ctx.offset,
            "count": self.count.value(),
            "amounts": self.amounts.get(),
            "items": dict(self.by_item.items()),
            "largest": self.largest.get(),
            "mean": self.mean.get(),
        }


def _module() -> str:
    name = "_snapline_stream_state_test"
    module = types.ModuleType(name)
    pipeline = Pipeline("state-map")
    pipeline.source(KafkaSource("in")).key_by().process(Everything()).sink(KafkaSink("out"))
    module.pipeline = pipeline  # type: ignore[attr-defined]
    sys.modules[name] = module
    return f"{name}:pipeline"


class _Handle:
    """Spark's StatefulProcessorHandle in memory: state variables scoped to ``self.key``."""

    def __init__(self) -> None:
        self.key: Any = None
        self.data: dict[tuple[str, Any], Any] = {}
        self.created: dict[str, str] = {}
        self.calls = 0

    def getValueState(self, name: str, schema: str) -> Any:
        self.created[name] = "value"
        return _Value(self, name)

    def getMapState(self, name: str, key_schema: str, value_schema: str) -> Any:
        self.created[name] = "map"
        return _Map(self, name)


class _Value:
    def __init__(self, handle: _Handle, name: str) -> None:
        self.h, self.name = handle, name

    def get(self) -> tuple[bytes] | None:
        self.h.calls += 1
        value = self.h.data.get((self.name, self.h.key))
        return None if value is None else (value,)

    def update(self, row: tuple[bytes]) -> None:
        self.h.calls += 1
        self.h.data[(self.name, self.h.key)] = row[0]

    def clear(self) -> None:
        self.h.calls += 1
        self.h.data.pop((self.name, self.h.key), None)


class _Map:
    def __init__(self, handle: _Handle, name: str) -> None:
        self.h, self.name = handle, name

    def _entries(self) -> dict[bytes, bytes]:
        return self.h.data.setdefault((self.name, self.h.key), {})  # type: ignore[no-any-return]

    def getValue(self, key: tuple[bytes]) -> tuple[bytes] | None:
        value = self._entries().get(key[0])
        return None if value is None else (value,)

    def updateValue(self, key: tuple[bytes], value: tuple[bytes]) -> None:
        self._entries()[key[0]] = value[0]

    def removeKey(self, key: tuple[bytes]) -> None:
        self._entries().pop(key[0], None)

    def iterator(self) -> Iterator[tuple[tuple[bytes], tuple[bytes]]]:
        return iter([((k,), (v,)) for k, v in self._entries().items()])

    def clear(self) -> None:
        self._entries().clear()


def _row(key: str, offset: int, amount: int, item: str) -> Row:
    return Row(
        key=tag_key(key, key.encode()),
        topic="in",
        partition=0,
        offset=offset,
        seq=0,
        ts=1000 + offset,
        value=pickle.dumps({"amount": amount, "item": item}),
        raw=b"{}",
        raw_key=key.encode(),
        reason=None,
        now=5000,
    )


def _batch(processor: Any, handle: _Handle, key: str, rows: list[Row]) -> list[dict[str, Any]]:
    handle.key = key
    tagged = tag_key(key, key.encode())
    out = list(processor.handleInputRows((tagged,), iter(rows), None))
    assert all(r.sink == 0 and r.reason is None for r in out)
    return [pickle.loads(r.value) for r in out]


@pytest.fixture
def processor_and_handle() -> tuple[Any, _Handle]:
    processor = keyed_processor(_module())
    handle = _Handle()
    processor.init(handle)
    return processor, handle


def test_each_state_type_maps_onto_a_spark_state_variable(
    processor_and_handle: tuple[Any, _Handle],
) -> None:
    _, handle = processor_and_handle
    uid = "Everything"
    assert handle.created == {
        spark_state_name(uid, "count"): "value",
        spark_state_name(uid, "amounts"): "value",
        spark_state_name(uid, "by_item"): "map",
        spark_state_name(uid, "largest"): "value",
        spark_state_name(uid, "mean"): "value",
    }


def test_state_survives_batches_per_key_in_offset_order(
    processor_and_handle: tuple[Any, _Handle],
) -> None:
    processor, handle = processor_and_handle
    # Spark hands a key's rows in any order: the processor runs them in offset order.
    first = _batch(processor, handle, "a", [_row("a", 2, 5, "y"), _row("a", 1, 3, "x")])
    assert [o["offset"] for o in first] == [1, 2]
    assert first[-1]["count"] == 2 and first[-1]["amounts"] == [3, 5]
    assert _batch(processor, handle, "b", [_row("b", 7, 100, "x")])[0]["count"] == 1
    (last,) = _batch(processor, handle, "a", [_row("a", 9, 4, "x")])
    assert last == {
        "key": "a",
        "offset": 9,
        "count": 3,
        "amounts": [3, 5, 4],
        "items": {"x": 2, "y": 1},
        "largest": 5,
        "mean": 4.0,
    }


def test_value_states_are_read_once_and_written_once_per_key_and_batch(
    processor_and_handle: tuple[Any, _Handle],
) -> None:
    processor, handle = processor_and_handle
    rows = [_row("a", i, i, "x") for i in range(50)]
    _batch(processor, handle, "a", rows)
    # 4 value-backed states: at most one get and one update each, whatever the row count.
    assert handle.calls <= 8


def test_user_code_error_becomes_a_dead_letter_row(
    processor_and_handle: tuple[Any, _Handle],
) -> None:
    processor, handle = processor_and_handle
    bad = _row("a", 3, 1, "x")
    bad = Row(**{**bad.asDict(), "value": pickle.dumps({"item": "x"})})  # no amount
    handle.key = "a"
    (out,) = list(processor.handleInputRows((bad.key,), iter([bad]), None))
    assert out.sink == -1 and "KeyError" in out.reason and out.value == b"{}"
