"""snapline.testing: a pipeline runs in-process over lists, through the real task, operators,
state backends and snapshot/restore code; a simulated crash changes nothing committed."""

from __future__ import annotations

import random
from typing import Any

import pytest

from examples.running_total import RunningTotal
from snapline import (
    Context,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    ParquetSink,
    Pipeline,
    ValueState,
)
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
    TypeError out of the worker, so every restart replayed the record and failed again (and
    a str, which the producer takes as UTF-8, failed when an epoch's records were held). Now
    a value that is neither bytes-like nor str is a dead letter naming the format; a str goes
    out as UTF-8, bytes-like values as bytes."""
    pipeline = Pipeline("raw-out")
    values = {1: b"one", 2: {"two": 2}, 3: "three", 4: bytearray(b"four"), 5: 5}
    pipeline.source(KafkaSource("in")).map(lambda v: values[v]).sink(
        KafkaSink("raw", value_format="bytes")
    )
    run = run_pipeline(pipeline, {"in": [1, 2, 3, 4, 5]})
    assert [bytes(v) if not isinstance(v, str) else v.encode() for v in run.outputs["raw"]] == [
        b"one",
        b"three",
        b"four",
    ]
    reasons = sorted(reason for _, reason in run.dead_letters)
    assert len(reasons) == 2
    assert all("value_format='bytes' takes bytes or str" in reason for reason in reasons)
    assert any("not dict" in reason for reason in reasons)
    assert any("not int" in reason for reason in reasons)


def counts_pipeline(guarantee: str, table: Any) -> Pipeline:
    pipeline = Pipeline("counts", guarantee=guarantee)
    counts = pipeline.source(KafkaSource("in")).key_by().count()
    counts.sink(KafkaSink("counts"))
    counts.sink(ParquetSink(str(table)))
    return pipeline


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
def test_at_least_once_shows_the_duplicates_a_crash_makes_as_a_worker_does(
    guarantee: str, tmp_path: Any
) -> None:
    """The harness held every output until its checkpoint committed whatever the guarantee,
    so an at-least-once pipeline looked exactly-once. At least once a worker has no
    transaction: what a Kafka sink and the dead-letter topic got before the crash stays,
    and the records read again produce it again; a two-phase-commit sink (Parquet) still
    publishes committed checkpoints only."""
    inputs: list[Any] = [Message(i, key="k") for i in range(10)]
    inputs[5] = Message(b"{not json", key=b"k")
    table = tmp_path / "table"
    run = run_pipeline(
        counts_pipeline(guarantee, table), {"in": inputs}, checkpoint_every=4, crash_after=7
    )
    counts = [o["value"] for o in run.outputs["counts"]]
    rows = [o["value"] for o in run.outputs[f"parquet:{table}"]]
    assert run.crashes == 1 and rows == list(range(1, 10))
    if guarantee == "exactly_once":
        assert counts == list(range(1, 10)) and len(run.dead_letters) == 1
    else:  # records 5-7 were read before and after the crash (the 6th a dead letter)
        assert counts == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9]
        assert [value for value, _ in run.dead_letters] == [b"{not json"] * 2


def test_parquet_rows_that_do_not_fit_the_table_are_dead_letters_as_in_a_worker(
    tmp_path: Any,
) -> None:
    """Only a KafkaSink's output was checked: a ParquetSink took any value, and a worker then
    dead-lettered the rows its RowConverter refuses and those whose partition directory is
    too long for a filesystem."""
    import pyarrow as pa

    pipeline = Pipeline("rows")
    source = pipeline.source(KafkaSource("in"))
    declared = ParquetSink(str(tmp_path / "declared"), schema=pa.schema([("n", pa.int64())]))
    source.filter(lambda v: "p" not in v).sink(declared)
    inferred = ParquetSink(str(tmp_path / "inferred"), partition_by="p")
    source.filter(lambda v: "p" in v).sink(inferred)
    rows = [{"n": 1}, {"n": "two"}, [3], {"n": 1.5}]
    rows += [{"p": "a", "n": 1}, {"p": "a", "n": "x"}]  # the first checkpoint's rows
    rows += [{"p": "x" * 300, "n": 3}, {"p": "b", "n": "four"}, {"p": "b", "n": 4}]
    run = run_pipeline(pipeline, {"in": rows}, checkpoint_every=6)
    assert run.outputs[declared.name] == [{"n": 1}]
    # The schema is inferred from the first checkpoint's rows (n: int64) and kept after it.
    assert run.outputs[inferred.name] == [{"p": "a", "n": 1}, {"p": "b", "n": 4}]
    reasons = [reason for _, reason in run.dead_letters]
    assert len(reasons) == 6, reasons
    assert "'two' (str) does not fit int64" in reasons[0]
    assert "row is a list, a Parquet table needs a dict" in reasons[1]
    assert "1.5 (float) does not fit int64" in reasons[2]
    assert "'x' (str) does not fit int64" in reasons[3]
    assert "is 302 bytes (escaped), over the 255" in reasons[4]
    assert "'four' (str) does not fit int64" in reasons[5]  # not a new schema's string
    assert not (tmp_path / "declared").exists() and not (tmp_path / "inferred").exists()


class Reminder(KeyedProcessFunction):
    """Each record sets an event-time timer 10 ms later; the timer reports the watermark
    it fired at and the records its key had then."""

    seen = ValueState("seen", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> None:
        assert ctx.timers is not None
        self.seen.update(self.seen.value() + 1)
        ctx.timers.register_event_time(ctx.timestamp + 10)

    def on_timer(self, timestamp: int, ctx: Context) -> Any:
        yield {
            "key": ctx.key,
            "at": timestamp,
            "watermark": ctx.watermark,
            "seen": self.seen.value(),
        }


def reminders_pipeline() -> Pipeline:
    pipeline = Pipeline("reminders")
    (
        pipeline.source(KafkaSource("events", timestamp=lambda v: v["ts"]))
        .key_by(lambda v: v["k"])  # a repartition topic: watermarks cross it at barriers
        .process(Reminder())
        .sink(KafkaSink("fired"))
    )
    return pipeline


@pytest.mark.parametrize("crash_after", [1, 2, 5, 7, 11, 17, [2, 5, 11, 17, 30]])
def test_a_crash_does_not_move_checkpoints_so_event_time_downstream_is_the_same(
    crash_after: int | list[int],
) -> None:
    """After a crash the harness counted the records read again towards its next checkpoint
    and started a new round over the channels, so checkpoints (where watermarks cross a
    repartition topic) fell elsewhere than without the crash: a timer at 15 fired at
    watermark 4 instead of 9. Checkpoints now follow input positions and the order of
    reading is restored with the checkpoint."""
    events = {"events": [{"k": f"k{i % 3}", "ts": i} for i in range(20)]}
    clean = run_pipeline(reminders_pipeline(), events, checkpoint_every=3)
    crashed = run_pipeline(
        reminders_pipeline(), events, checkpoint_every=3, crash_after=crash_after
    )
    assert crashed.crashes == (1 if isinstance(crash_after, int) else len(crash_after))
    assert crashed.outputs["fired"] == clean.outputs["fired"]
    assert sorted(o["at"] for o in clean.outputs["fired"]) == list(range(10, 30))


def test_message_keys_are_encoded_in_the_sources_key_format() -> None:
    """A Message's key was encoded as a Kafka key is by a sink (a str as its UTF-8 bytes)
    whatever the source's key_format: with "json" the key "abc" was a dead letter and "7"
    arrived as the int 7."""
    pipeline = Pipeline("keys")
    source = KafkaSource("in", key_format="json")
    pipeline.source(source).key_by().count().sink(KafkaSink("counts"))
    inputs = [Message(1, key="abc"), Message(2, key="7"), Message(3, key=b'"abc"')]
    run = run_pipeline(pipeline, {"in": inputs})
    assert run.dead_letters == []
    assert run.outputs["counts"] == [
        {"key": "abc", "value": 1},
        {"key": "7", "value": 1},
        {"key": "abc", "value": 2},
    ]
    raw = Pipeline("raw-keys")
    raw.source(KafkaSource("in", key_format="bytes")).sink(KafkaSink("out"))
    with pytest.raises(ValueError, match="key 7 for topic 'in' cannot be encoded in the"):
        run_pipeline(raw, {"in": [Message(1, key=7)]})
