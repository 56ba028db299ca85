"""snapline.testing: a pipeline runs in-process over lists, through the real task, operators,
state backends and snapshot/restore code; a simulated crash changes nothing committed."""

from __future__ import annotations

import random
from typing import Any

import pytest

from examples.running_total import RunningTotal
from snapline import KafkaSink, KafkaSource, ParquetSink, Pipeline
from snapline.testing import Message, run_pipeline


def orders(count: int, customers: int = 7, seed: int = 3) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"customer": f"c{rng.randrange(customers)}", "amount": rng.randrange(1, 50), "order_id": i}
        for i in range(count)
    ]


def totals_pipeline(backend: str = "memory") -> Pipeline:
    pipeline = Pipeline("totals", state_backend=backend)
    (
        pipeline.source(KafkaSource("orders", value_format="json"))
        .key_by(lambda o: o["customer"])
        .process(RunningTotal())
        .sink(KafkaSink("customer-totals", value_format="json"))
    )
    return pipeline


def expected_totals(inputs: list[dict[str, Any]]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for o in inputs:
        totals[o["customer"]] = totals.get(o["customer"], 0) + o["amount"]
    return totals


def final(outputs: list[dict[str, Any]]) -> dict[str, int]:
    return {o["customer"]: o["total"] for o in outputs}


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_outputs_are_the_same_with_and_without_crashes(backend: str) -> None:
    inputs = orders(600)
    clean = run_pipeline(totals_pipeline(backend), {"orders": inputs}, checkpoint_every=50)
    crashed = run_pipeline(
        totals_pipeline(backend),
        {"orders": inputs},
        checkpoint_every=50,
        crash_after=[120, 333, 334, 590],
    )
    assert crashed.crashes == 4 and clean.crashes == 0
    assert crashed.outputs["customer-totals"] == clean.outputs["customer-totals"]
    outputs = clean.outputs["customer-totals"]
    assert sorted(o["order_id"] for o in outputs) == list(range(600))  # each input once
    assert final(outputs) == expected_totals(inputs)


def test_every_sink_is_captured_by_name_and_kafka_sinks_by_topic(tmp_path: Any) -> None:
    pipeline = Pipeline("totals")
    totals = (
        pipeline.source(KafkaSource("orders", value_format="json"))
        .key_by(lambda o: o["customer"])
        .process(RunningTotal())
    )
    totals.sink(KafkaSink("customer-totals", value_format="json"))
    table = ParquetSink(str(tmp_path / "table"))
    totals.sink(table)
    result = run_pipeline(pipeline, {"orders": orders(10)}, crash_after=4)
    assert len(result.outputs["customer-totals"]) == 10
    assert result.outputs[table.name] == result.outputs["customer-totals"]
    assert not (tmp_path / "table").exists(), "the real sink was written"


def test_bad_records_go_to_dead_letters_and_crashes_do_not_duplicate_them() -> None:
    inputs: list[Any] = orders(40)
    inputs[5] = Message(b"{not json", key=b"x")
    inputs[20] = {"customer": "c1", "order_id": 20}  # no amount: RunningTotal raises
    result = run_pipeline(totals_pipeline(), {"orders": inputs}, checkpoint_every=7, crash_after=25)
    reasons = [reason for _, reason in result.dead_letters]
    assert len(reasons) == 2, reasons
    assert "cannot decode" in reasons[0] and "KeyError" in reasons[1]
    assert len(result.outputs["customer-totals"]) == 38


def test_inputs_for_unknown_topics_are_refused() -> None:
    with pytest.raises(ValueError, match="no source reads"):
        run_pipeline(totals_pipeline(), {"payments": []})


def test_output_a_kafka_sink_cannot_encode_is_a_dead_letter_as_in_a_worker() -> None:
    """Every sink was a plain list in the harness: a value the KafkaSink's format cannot
    encode (a set) or a key function that raises passed the user's test, and a worker then
    dead-lettered those records. The harness now checks each value as the sink would."""
    pipeline = Pipeline("parity")
    source = pipeline.source(KafkaSource("in"))
    source.map(lambda v: {"id": v, "tags": {"a"}} if v == 1 else {"id": v}).sink(
        KafkaSink("tagged")
    )
    source.map(lambda v: {"id": v}).sink(KafkaSink("keyed", key=lambda v: v["customer"]))
    run = run_pipeline(pipeline, {"in": [1, 2]})
    assert run.outputs["tagged"] == [{"id": 2}]
    assert run.outputs["keyed"] == []
    reasons = sorted(reason for _, reason in run.dead_letters)
    assert len(reasons) == 3
    assert "keyed: cannot encode output: KeyError('customer')" in reasons[0]
    assert (
        "tagged: cannot encode output: TypeError('Type is not JSON serializable: set')"
        in (reasons[2])
    )


def test_output_that_is_not_bytes_for_a_bytes_sink_is_a_dead_letter() -> None:
    """``value_format="bytes"`` passed any value through to the producer: a dict raised its
    TypeError out of the worker (and a str, fine on the direct path, raised when an epoch's
    records were held), so every restart replayed the record and failed again. Now what is
    not bytes is a dead letter naming the format; bytes-like values go out as bytes."""
    pipeline = Pipeline("raw-out")
    values = {1: b"one", 2: {"two": 2}, 3: "three", 4: bytearray(b"four")}
    pipeline.source(KafkaSource("in")).map(lambda v: values[v]).sink(
        KafkaSink("raw", value_format="bytes")
    )
    run = run_pipeline(pipeline, {"in": [1, 2, 3, 4]})
    assert run.outputs["raw"] == [b"one", b"four"]
    reasons = sorted(reason for _, reason in run.dead_letters)
    assert len(reasons) == 2
    assert all("value_format='bytes' takes bytes" in reason for reason in reasons)
    assert any("not dict" in reason for reason in reasons)
    assert any("not str" in reason for reason in reasons)
