"""The same pipeline on Spark, continuous (DESIGN §10): ``snapline spark stream`` runs the
declared pipeline as a Structured Streaming query.

The query: Spark's Kafka source (``read_committed``) → the part before ``key_by`` as an Arrow
map (``stream_ops.first_part``) → ``groupBy(key).transformWithState`` running the keyed process
functions with their state in Spark's RocksDB state store (changelog checkpointing on) →
``foreachBatch`` committing each micro-batch exactly-once into the sinks
(``stream_commit.BatchCommitter``). A pipeline part that does not map fails at start
(``stream_plan.plan_stream``). Restarting with the same ``--checkpoint-location`` continues
where the query stopped or crashed.

Threads: the driver's main thread starts the query and waits; Spark's stream execution thread
calls ``foreachBatch``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from snapline.pipeline.errors import ConfigurationError

log = logging.getLogger(__name__)

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


@dataclass(frozen=True)
class Trigger:
    """``processing-time=5s`` (a micro-batch every interval) or ``available-now`` (everything
    available at start, then stop)."""

    available_now: bool = False
    interval: str = "5 seconds"

    @staticmethod
    def parse(text: str) -> Trigger:
        if text == "available-now":
            return Trigger(available_now=True)
        match = re.fullmatch(r"processing-time=(\d+(?:\.\d+)?)(ms|s)", text.strip())
        if match is None:
            raise ConfigurationError(
                f"--trigger {text!r}: use processing-time=<n>s (e.g. processing-time=5s), "
                "processing-time=<n>ms, or available-now"
            )
        unit = "milliseconds" if match.group(2) == "ms" else "seconds"
        return Trigger(interval=f"{match.group(1)} {unit}")


def run_stream(
    spec: str,
    kafka_config: dict[str, Any],
    checkpoint_dir: str,
    checkpoint_location: str,
    *,
    trigger: Trigger,
    master: str = "local[2]",
    max_records_per_batch: int | None = None,
    state_partitions: int = 4,
    progress: Callable[[str], None] | None = None,
) -> int:
    """Run ``spec`` as a streaming query until it stops (available-now) or fails; returns the
    number of batches this driver committed."""
    from pyspark.sql import functions as F

    from snapline.pipeline.graph import load_pipeline
    from snapline.pipeline.runtime.topics import Role, TopicManager, pipeline_topics
    from snapline.pipeline.spark.jars import spark_session
    from snapline.pipeline.spark.stream_commit import BatchCommitter
    from snapline.pipeline.spark.stream_ops import (
        KEYED_SCHEMA,
        OUT_SCHEMA,
        first_part,
        keyed_processor,
    )
    from snapline.pipeline.spark.stream_plan import plan_stream

    say = progress or (lambda message: log.info("%s", message))
    sys.path.insert(0, os.getcwd())
    pipeline = load_pipeline(spec)
    plan = plan_stream(pipeline)  # refuses what cannot map, before anything starts
    for sink in plan.sinks:
        sink.validate()
    where = str(kafka_config.get("bootstrap.servers"))
    # A re-keying key_by is a Spark shuffle here: no repartition topic.
    topics = [t for t in pipeline_topics(pipeline) if t.role is not Role.INTERNAL]
    TopicManager(kafka_config, where).ensure(topics)
    committer = BatchCommitter(
        pipeline, plan.sinks, kafka_config, checkpoint_dir, checkpoint_location
    )
    committed = committer.open()
    if plan.timed is not None and len(plan.sources) > 1:
        say(
            "note: the query's one watermark follows the largest event time of all "
            f"{len(plan.sources)} sources less the largest max_out_of_orderness; a source whose "
            "event times lag the others by more than that has its records late here (the "
            "services hold the watermark back for it: docs/spark.md)"
        )
    say(
        f"query {committer.query} of {pipeline.name}: last committed batch "
        f"{committed - 1 if committed else 'none'}; sinks {[s.name for s in plan.sinks]}"
    )
    spark = spark_session(
        master,
        f"snapline-stream-{pipeline.name}",
        state_partitions,
        {
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
            "spark.sql.execution.arrow.pyspark.enabled": "true",
        },
    )
    spark.sparkContext.setLogLevel("WARN")
    try:
        source = plan.source
        reader = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", where)
            .option("kafka.isolation.level", "read_committed")
            .option("subscribe", ",".join(plan.topics))
            .option("startingOffsets", source.starting_position)
            # Records the query has not read yet that Kafka deleted (retention while the query
            # was stopped, a topic recreated) fail it: "false" skipped them with a log warning.
            .option("failOnDataLoss", "true")
        )
        if max_records_per_batch:
            reader = reader.option("maxOffsetsPerTrigger", str(max_records_per_batch))
        for key, value in pipeline.kafka_config.items():
            reader = reader.option(f"kafka.{key}", str(value))
        raw = reader.load().select(
            "topic",
            "partition",
            "offset",
            "key",
            "value",
            F.unix_millis("timestamp").alias("ts"),
            # the batch's timestamp: the same when Spark re-runs the batch after a crash
            F.unix_millis(F.current_timestamp()).alias("now"),
        )
        if plan.key_by is None:
            out = raw.mapInArrow(first_part(spec), OUT_SCHEMA)
        else:
            keyed = raw.mapInArrow(first_part(spec), KEYED_SCHEMA)
            time_mode = "None"
            if plan.timed is not None:
                # Event time for windows and timers: Spark's watermark trails the largest event
                # time seen by the sources' largest max_out_of_orderness (one per query).
                delay = plan.max_out_of_orderness
                keyed = keyed.withColumn("event_time", event_time_column()).withWatermark(
                    "event_time", f"{delay} milliseconds"
                )
                time_mode = "EventTime"
            out = keyed.groupBy("key").transformWithState(
                keyed_processor(spec), OUT_SCHEMA, "Append", time_mode
            )
        writer = (
            out.writeStream.foreachBatch(committer)
            .option("checkpointLocation", checkpoint_location)
            .queryName(f"snapline_{pipeline.name}".replace("-", "_").replace(".", "_"))
        )
        if trigger.available_now:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(processingTime=trigger.interval)
        query = writer.start()
        say(f"query started; checkpoint location {checkpoint_location}")
        started = time.monotonic()
        try:
            query.awaitTermination()
        except Exception as exc:
            if "Some data may have been lost" in str(exc) or "offset was changed" in str(exc):
                raise ConfigurationError(
                    f"query {committer.query}: Kafka no longer has records of the source topics "
                    "that the query has not processed (retention deleted them while it was "
                    "stopped or behind, or a topic was deleted and recreated); Spark says: "
                    f"{_data_loss_reason(str(exc))}. Going on would skip them. To accept the "
                    "loss, start the query with a new --checkpoint-location (a new query: "
                    "its state starts empty, from the source's starting_position)"
                ) from exc
            raise
        written = sum(1 for b in committer.history if b.written)
        say(f"query stopped after {time.monotonic() - started:.1f}s: {written} batches committed")
        return written
    finally:
        committer.close()
        spark.stop()


def _data_loss_reason(text: str) -> str:
    """The line of Spark's KAFKA_DATA_LOSS error that names the partition and offsets."""
    for line in text.splitlines():
        if (
            "Could not read records" in line
            or "offset was changed" in line
            or ("have been deleted" in line or "instead of 0" in line)
        ):
            return line.strip()
    return text.splitlines()[0] if text else text


def event_time_column() -> Any:
    """The watermark column of the keyed part's input: the event time of the clock rows
    (``stream_ops.CLOCK_KEY``), null for every other row. Spark's watermark follows the clock
    rows; the records, without a value, are never dropped as late before the processor."""
    from pyspark.sql import functions as F

    from snapline.pipeline.spark.stream_ops import CLOCK_SEQ

    return F.when(F.col("seq") == F.lit(CLOCK_SEQ), F.timestamp_millis("ts"))
