"""Small pipelines used by integration tests (topic names from SNAPLINE_TEST_PREFIX)."""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Iterator
from typing import Any

from snapline.connectors import KafkaSource
from snapline.pipeline import (
    AggregateFunction,
    Context,
    KeyedCoProcessFunction,
    KeyedProcessFunction,
    Pipeline,
    ValueState,
)
from snapline.sinks import KafkaSink

PREFIX = os.environ.get("SNAPLINE_TEST_PREFIX", "test-")


class StrictTotal(KeyedProcessFunction):
    """Raises on a non-integer amount: that record must go to the dead-letter topic."""

    total = ValueState("total", default=0)

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        amount = value["amount"]
        if not isinstance(amount, int):
            raise TypeError(f"amount must be an int, got {amount!r}")
        total = self.total.value() + amount
        self.total.update(total)
        yield {"customer": ctx.key, "total": total, "order_id": value["order_id"]}


def dead_letters() -> Pipeline:
    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    (
        pipeline.source(KafkaSource(f"{PREFIX}orders"))
        .key_by()  # orders are keyed by customer: the dead letters name the orders topic
        .process(StrictTotal())
        .sink(KafkaSink(f"{PREFIX}totals"))
    )
    return pipeline


def dead_letters_rekeyed() -> Pipeline:
    """``dead_letters`` with a re-keying ``key_by``: the orders cross a repartition topic, and
    the ones StrictTotal raises on are dead letters of the keyed stage."""
    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    (
        pipeline.source(KafkaSource(f"{PREFIX}orders"))
        .key_by(lambda v: v["customer"], name="by-customer", partitions=2)
        .process(StrictTotal())
        .sink(KafkaSink(f"{PREFIX}totals"))
    )
    return pipeline


#: Bytes of padding that make an output too large (default: over the producer's 1 MB limit).
PAD = int(os.environ.get("SNAPLINE_TEST_PAD", "1100000"))


def _pad_every_50th(value: dict[str, Any]) -> dict[str, Any]:
    if value["order_id"] % 50 == 7:  # an output too large to produce
        # Random hex, which lz4 does not shrink: the broker checks a topic's limit against
        # the compressed batch, and a run of one letter would compress to a few hundred bytes.
        return {**value, "pad": random.Random(value["order_id"]).randbytes(PAD // 2).hex()}
    return value


def oversized() -> Pipeline:
    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    (
        pipeline.source(KafkaSource(f"{PREFIX}orders"))
        .map(_pad_every_50th)
        .sink(KafkaSink(f"{PREFIX}totals"))
    )
    return pipeline


def missing_topic() -> Pipeline:
    pipeline = Pipeline(f"{PREFIX}job")
    pipeline.source(KafkaSource(f"{PREFIX}no-such-topic")).sink(KafkaSink(f"{PREFIX}out"))
    return pipeline


def repartition_mismatch() -> Pipeline:
    pipeline = Pipeline(f"{PREFIX}job")
    (
        pipeline.source(KafkaSource(f"{PREFIX}orders"))
        .key_by(lambda v: v["region"], partitions=4)
        .process(StrictTotal())
        .sink(KafkaSink(f"{PREFIX}totals"))
    )
    return pipeline


def embedded_total() -> Pipeline:
    """The running total of examples/, on topics it creates itself (for the embedded broker)."""
    from examples.running_total import RunningTotal

    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.5)
    (
        pipeline.source(KafkaSource(f"{PREFIX}orders", create_partitions=2))
        .key_by(lambda v: v["customer"])
        .process(RunningTotal())
        .sink(KafkaSink(f"{PREFIX}totals"))
    )
    return pipeline


def _stall_on_request(value: dict[str, Any]) -> dict[str, Any]:
    """Passes orders through; an order with ``stall`` blocks the task thread for good:
    "sleep" outside the GIL, "regex" inside it (a backtracking match that never ends)."""
    how = value.get("stall")
    if how == "sleep":
        time.sleep(86_400)
    elif how == "regex":
        re.match(r"(a+)+$", "a" * 64 + "!")
    return value


def stalls() -> Pipeline:
    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    pipeline.source(KafkaSource(f"{PREFIX}orders")).map(_stall_on_request).sink(
        KafkaSink(f"{PREFIX}out")
    )
    return pipeline


#: late_records: the window's size and allowed lateness (ms).
LATE_WINDOW_MS, LATE_ALLOWED_MS = 1000, 5000


def late_records() -> Pipeline:
    """Event time from the value's ``t``; per key a tumbling count with allowed lateness and,
    beside it, a rolling count of every record (the Spark streaming late-record test)."""
    from snapline import tumbling

    pipeline = Pipeline(f"{PREFIX}late", checkpoint_interval=0.3)
    keyed = pipeline.source(
        KafkaSource(
            f"{PREFIX}late-in",
            value_format="json",
            timestamp=lambda v: v["t"],
            max_out_of_orderness=0,
        )
    ).key_by()
    windows = keyed.window(tumbling(LATE_WINDOW_MS), allowed_lateness=LATE_ALLOWED_MS).count()
    windows.sink(KafkaSink(f"{PREFIX}late-windows", value_format="json"))
    keyed.count().sink(KafkaSink(f"{PREFIX}late-counts", value_format="json"))
    return pipeline


def before_key_by() -> Pipeline:
    """Sinks and a branch before ``key_by`` beside a keyed count (the Spark streaming
    pass-through test): every record raw, the even ones mapped, and per key a rolling count."""
    pipeline = Pipeline(f"{PREFIX}before", checkpoint_interval=0.3)
    source = pipeline.source(KafkaSource(f"{PREFIX}before-in", value_format="json"))
    source.sink(KafkaSink(f"{PREFIX}before-raw", value_format="json"))
    source.filter(lambda v: v["n"] % 2 == 0).map(lambda v: {"even": v["n"]}).sink(
        KafkaSink(f"{PREFIX}before-even", value_format="json")
    )
    source.key_by().count().sink(KafkaSink(f"{PREFIX}before-counts", value_format="json"))
    return pipeline


def union_sources() -> Pipeline:
    """Two sources of different value formats meet at a union before ``key_by`` (the Spark
    streaming union test): JSON orders, and text lines "n=<i>" mapped to the same shape (their
    raw lines also go to a sink of their own); per key a rolling count of both."""
    pipeline = Pipeline(f"{PREFIX}union", checkpoint_interval=0.3)
    orders = pipeline.source(KafkaSource(f"{PREFIX}union-json", value_format="json"))
    lines = pipeline.source(KafkaSource(f"{PREFIX}union-text", value_format="string"))
    lines.sink(KafkaSink(f"{PREFIX}union-text-raw", value_format="json"))
    parsed = lines.map(lambda line: {"n": int(line.split("=")[1])})
    orders.union(parsed).key_by().count().sink(
        KafkaSink(f"{PREFIX}union-counts", value_format="json")
    )
    return pipeline


class _TierOf(KeyedCoProcessFunction):
    """Left: orders; right: tiers of the same customer (keys of another type, same bytes)."""

    tier = ValueState("tier")

    def process_left(self, order: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        yield {"n": order["n"], "key": ctx.key, "tier": self.tier.value()}

    def process_right(self, tier: dict[str, Any], ctx: Context) -> None:
        self.tier.update(tier["tier"])


def mixed_key_join() -> Pipeline:
    """A join whose sides key by the same customer as an int (orders) and as a string (tiers):
    the services scope state by the key's bytes, so both meet (the Spark streaming test)."""
    pipeline = Pipeline(f"{PREFIX}mixed", checkpoint_interval=0.3)
    orders = pipeline.source(KafkaSource(f"{PREFIX}mixed-orders", value_format="json"))
    tiers = pipeline.source(KafkaSource(f"{PREFIX}mixed-tiers", value_format="json"))
    joined = orders.key_by(lambda o: o["c"]).connect(tiers.key_by(lambda t: str(t["c"])))
    joined.process(_TierOf()).sink(KafkaSink(f"{PREFIX}mixed-out", value_format="json"))
    return pipeline


class _Stamp(KeyedProcessFunction):
    """The event time the keyed stage sees beside the one the source read."""

    def process(self, value: dict[str, Any], ctx: Context) -> Iterator[dict[str, Any]]:
        yield {"k": value["k"], "sent": value["t"], "seen": ctx.timestamp}


def event_times() -> Pipeline:
    """Event time from the value's ``t`` across a re-keying key_by (a repartition topic)."""
    pipeline = Pipeline(f"{PREFIX}times", checkpoint_interval=0.3)
    (
        pipeline.source(KafkaSource(f"{PREFIX}times-in", timestamp=lambda v: v["t"]))
        .key_by(lambda v: v["k"])
        .process(_Stamp())
        .sink(KafkaSink(f"{PREFIX}times-out"))
    )
    return pipeline


class _Concat(AggregateFunction[dict[str, Any], str, str]):
    """Every record's ``pad`` joined: a window result as large as its records together."""

    def create_accumulator(self) -> str:
        return ""

    def add(self, value: dict[str, Any], accumulator: str) -> str:
        return accumulator + value["pad"]

    def merge(self, a: str, b: str) -> str:
        return a + b

    def get_result(self, accumulator: str) -> str:
        return accumulator


def big_windows() -> Pipeline:
    """Per key a tumbling window of 1 s whose result joins its records' pads (the test makes
    one window's result larger than the output topic takes)."""
    from snapline import tumbling

    pipeline = Pipeline(f"{PREFIX}big", checkpoint_interval=0.3)
    (
        pipeline.source(
            KafkaSource(f"{PREFIX}big-in", timestamp=lambda v: v["t"], max_out_of_orderness=0)
        )
        .key_by(lambda v: v["k"])
        .window(tumbling(1000))
        .aggregate(_Concat())
        .sink(KafkaSink(f"{PREFIX}big-out"))
    )
    return pipeline


class _Count(KeyedProcessFunction):
    """A count per key, its state declared with ``$SNAPLINE_TEST_TTL`` seconds of TTL (unset:
    none)."""

    ttl = os.environ.get("SNAPLINE_TEST_TTL")
    n = ValueState("n", default=0, ttl=float(ttl) if ttl else None)

    def process(self, value: Any, ctx: Context) -> Iterator[dict[str, Any]]:
        self.n.update(self.n.value() + 1)
        yield {"key": ctx.key, "n": self.n.value()}


def ttl_counts() -> Pipeline:
    pipeline = Pipeline(f"{PREFIX}ttl", checkpoint_interval=0.3)
    (
        pipeline.source(KafkaSource(f"{PREFIX}ttl-in"))
        .key_by(lambda v: v["k"])
        .process(_Count(), uid="count")
        .sink(KafkaSink(f"{PREFIX}ttl-out"))
    )
    return pipeline


def keyed_count() -> Pipeline:
    """``<prefix>copy-in`` keyed by the Kafka key, a count per key (``_Count``, uid
    ``count``) to ``<prefix>copy-out``: output that shows the state a restore started from."""
    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    (
        pipeline.source(KafkaSource(f"{PREFIX}copy-in"))
        .key_by()
        .process(_Count(), uid="count")
        .sink(KafkaSink(f"{PREFIX}copy-out"))
    )
    return pipeline


def named_copy() -> Pipeline:
    """Orders copied to ``<prefix>copy-out``, as job ``$SNAPLINE_TEST_JOB`` (default
    ``<prefix>job``): two jobs of one code under names that differ."""
    pipeline = Pipeline(
        os.environ.get("SNAPLINE_TEST_JOB", f"{PREFIX}job"), checkpoint_interval=0.3
    )
    pipeline.source(KafkaSource(f"{PREFIX}copy-in")).sink(KafkaSink(f"{PREFIX}copy-out"))
    return pipeline


class DelayedEcho(KeyedProcessFunction):
    """Each record comes out ``$SNAPLINE_TEST_DELAY_MS`` after it was read, from a processing-
    time timer: output that only a running task produces."""

    pending = ValueState("pending")

    def process(self, value: dict[str, Any], ctx: Context) -> None:
        assert ctx.timers is not None
        self.pending.update(value)
        delay = int(os.environ.get("SNAPLINE_TEST_DELAY_MS", "5000"))
        ctx.timers.register_processing_time(ctx.timers.current_processing_time() + delay)

    def on_timer(self, timestamp: int, ctx: Context) -> Iterator[dict[str, Any]]:
        yield self.pending.value()
        self.pending.clear()


def delayed_echo() -> Pipeline:
    """``<prefix>copy-in`` (keyed by the Kafka key) to ``<prefix>copy-out`` through
    ``DelayedEcho``, in one stage."""
    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    (
        pipeline.source(KafkaSource(f"{PREFIX}copy-in"))
        .key_by()
        .process(DelayedEcho())
        .sink(KafkaSink(f"{PREFIX}copy-out"))
    )
    return pipeline


def latest_copy() -> Pipeline:
    """``<prefix>copy-in`` and ``<prefix>copy-in2`` (one task per partition reads both), each
    from its end when the job starts (``starting_position="latest"``), copied to
    ``<prefix>copy-out``."""
    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    source = KafkaSource((f"{PREFIX}copy-in", f"{PREFIX}copy-in2"), starting_position="latest")
    pipeline.source(source).sink(KafkaSink(f"{PREFIX}copy-out"))
    return pipeline


def latest_copy_parquet() -> Pipeline:
    """``<prefix>copy-in`` from its end when the job starts, copied to ``<prefix>copy-out``
    and to the Parquet table ``$SNAPLINE_TEST_TABLE`` (staged before Kafka commits, published
    after)."""
    from snapline.sinks import ParquetSink

    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    stream = pipeline.source(KafkaSource(f"{PREFIX}copy-in", starting_position="latest"))
    stream.sink(KafkaSink(f"{PREFIX}copy-out"))
    stream.sink(ParquetSink(os.environ["SNAPLINE_TEST_TABLE"], name="table"))
    return pipeline


def latest_grow() -> Pipeline:
    """``<prefix>copy-in`` from its end when the job starts, copied to ``<prefix>copy-out``;
    the consumer looks for new partitions every second (librdkafka's default: 5 minutes)."""
    pipeline = Pipeline(
        f"{PREFIX}job",
        checkpoint_interval=0.3,
        kafka_config={"topic.metadata.refresh.interval.ms": 1000},
    )
    pipeline.source(KafkaSource(f"{PREFIX}copy-in", starting_position="latest")).sink(
        KafkaSink(f"{PREFIX}copy-out")
    )
    return pipeline


def two_topic_copy() -> Pipeline:
    """Records of ``<prefix>copy-in`` and ``<prefix>copy-in2`` (one task per partition reads
    both) copied to ``<prefix>copy-out``."""
    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    pipeline.source(KafkaSource((f"{PREFIX}copy-in", f"{PREFIX}copy-in2"))).sink(
        KafkaSink(f"{PREFIX}copy-out")
    )
    return pipeline


def named_rekey() -> Pipeline:
    """Orders re-keyed by ``n`` through ``key_by(name=$SNAPLINE_TEST_KEY_BY)`` (default
    ``by-n``) to ``<prefix>copy-out``, as job ``$SNAPLINE_TEST_JOB`` (default ``<prefix>job``):
    two jobs whose repartition topics may have one name."""
    pipeline = Pipeline(
        os.environ.get("SNAPLINE_TEST_JOB", f"{PREFIX}job"), checkpoint_interval=0.3
    )
    (
        pipeline.source(KafkaSource(f"{PREFIX}copy-in", value_format="json"))
        .key_by(lambda v: v["n"], name=os.environ.get("SNAPLINE_TEST_KEY_BY", "by-n"))
        .sink(KafkaSink(f"{PREFIX}copy-out", value_format="json"))
    )
    return pipeline


def slow_copy() -> Pipeline:
    """Orders copied to ``<prefix>copy-out``, each after ``$SNAPLINE_TEST_SLEEP`` seconds: a
    task that runs for longer than its transaction timeout. The prefix is read when called
    (tests call it in their own process)."""
    prefix = os.environ.get("SNAPLINE_TEST_PREFIX", "")
    pause = float(os.environ.get("SNAPLINE_TEST_SLEEP", "0"))

    def slow(value: bytes) -> bytes:
        time.sleep(pause)
        return value

    pipeline = Pipeline(f"{prefix}job")
    pipeline.source(KafkaSource(f"{prefix}copy-in")).map(slow).sink(KafkaSink(f"{prefix}copy-out"))
    return pipeline


def window_counts() -> Pipeline:
    """Per key a tumbling window of 1 s counting records (event time from ``t``, allowed
    lateness 0), re-keyed through ``key_by(name="by-k")``: a late record is a dead letter."""
    return _window_counts({})


def window_counts_grow() -> Pipeline:
    """``window_counts`` whose consumer looks for new partitions every second (librdkafka's
    default: 5 minutes)."""
    return _window_counts({"topic.metadata.refresh.interval.ms": 1000})


def _window_counts(kafka_config: dict[str, Any]) -> Pipeline:
    from snapline import tumbling

    prefix = os.environ.get("SNAPLINE_TEST_PREFIX", "")
    pipeline = Pipeline(f"{prefix}win", checkpoint_interval=0.3, kafka_config=kafka_config)
    (
        pipeline.source(
            KafkaSource(f"{prefix}win-in", timestamp=lambda v: v["t"], max_out_of_orderness=0)
        )
        .key_by(lambda v: v["k"], name="by-k")
        .window(tumbling(1000))
        .count()
        .sink(KafkaSink(f"{prefix}win-out"))
    )
    return pipeline


def delayed_echo_rekeyed() -> Pipeline:
    """``delayed_echo`` whose output goes through a second stage (re-keyed by the record's
    ``n`` through ``<job>.again.repartition``) to ``<prefix>copy-out``: the timers' output is a
    record in flight of a repartition topic."""
    pipeline = Pipeline(f"{PREFIX}job", checkpoint_interval=0.3)
    (
        pipeline.source(KafkaSource(f"{PREFIX}copy-in"))
        .key_by()
        .process(DelayedEcho())
        .key_by(lambda v: str(v["n"]), name="again")
        .map(lambda v: v)
        .sink(KafkaSink(f"{PREFIX}copy-out"))
    )
    return pipeline


def union_copy_grow() -> Pipeline:
    """JSON records of ``<prefix>copy-in`` and ``<prefix>copy-in2`` unioned (task p reads
    partition p of both) and copied to ``<prefix>copy-out``; the consumer looks for new
    partitions every second."""
    pipeline = Pipeline(
        f"{PREFIX}job",
        checkpoint_interval=0.3,
        kafka_config={"topic.metadata.refresh.interval.ms": 1000},
    )
    first = pipeline.source(KafkaSource(f"{PREFIX}copy-in", value_format="json"))
    second = pipeline.source(KafkaSource(f"{PREFIX}copy-in2", value_format="json"))
    first.union(second).sink(KafkaSink(f"{PREFIX}copy-out"))
    return pipeline
