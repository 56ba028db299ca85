"""Snapline: exactly-once stream pipelines on Apache Kafka.

The public API is importable from here: ``from snapline import Pipeline, KafkaSource, ...``.
Everything under ``snapline.pipeline``, ``snapline.connectors`` and ``snapline.sinks`` that
is not re-exported here may change between releases.
"""

from typing import TYPE_CHECKING, Any

from snapline.connectors.kafka_source import KafkaSource
from snapline.pipeline.errors import (
    CheckpointError,
    ConfigurationError,
    CorruptCheckpointError,
    SinkError,
    SinkUnavailableError,
    SnaplineError,
    StateError,
)
from snapline.pipeline.functions import Context, KeyedCoProcessFunction, KeyedProcessFunction
from snapline.pipeline.graph import ConnectedStreams, KeyedStream, Pipeline, Stream
from snapline.pipeline.runtime.timers import TimerService
from snapline.pipeline.sink import Sink, SinkContext, SinkWriter
from snapline.pipeline.state.descriptors import (
    AggregateFunction,
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    ValueState,
)
from snapline.pipeline.state.serde import JsonSerde, PickleSerde, Serde
from snapline.pipeline.windows import WindowedStream, hopping, session, sliding, tumbling
from snapline.sinks.kafka import KafkaSink

if TYPE_CHECKING:  # imported on first use (__getattr__ below)
    from snapline.sinks.parquet import ParquetSink

__version__ = "0.1.0"

__all__ = [
    "AggregateFunction",
    "AggregatingState",
    "CheckpointError",
    "ConfigurationError",
    "ConnectedStreams",
    "Context",
    "CorruptCheckpointError",
    "JsonSerde",
    "KafkaSink",
    "KafkaSource",
    "KeyedCoProcessFunction",
    "KeyedProcessFunction",
    "KeyedStream",
    "ListState",
    "LocalKafkaBroker",
    "LocalKafkaCluster",
    "MapState",
    "ParquetSink",
    "PickleSerde",
    "Pipeline",
    "PostgresSink",
    "ReducingState",
    "Serde",
    "Sink",
    "SinkContext",
    "SinkError",
    "SinkUnavailableError",
    "SinkWriter",
    "SnaplineError",
    "StateError",
    "Stream",
    "TimerService",
    "ValueState",
    "WindowedStream",
    "hopping",
    "session",
    "sliding",
    "tumbling",
]


def __getattr__(name: str) -> Any:
    # Optional or heavy pieces load on first use: PostgresSink needs the 'postgres' extra
    # (psycopg), ParquetSink pyarrow (~0.3 s of a worker's start), the broker launcher
    # subprocess/ctypes machinery.
    if name == "ParquetSink":
        from snapline.sinks.parquet import ParquetSink

        return ParquetSink
    if name == "PostgresSink":
        from snapline import sinks

        return sinks.PostgresSink
    if name == "LocalKafkaBroker":
        from snapline.connectors.local.broker import LocalKafkaBroker

        return LocalKafkaBroker
    if name == "LocalKafkaCluster":
        from snapline.connectors.local.cluster import LocalKafkaCluster

        return LocalKafkaCluster
    raise AttributeError(name)
