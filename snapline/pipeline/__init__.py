"""Snapline: exactly-once stream pipelines on Apache Kafka.

Public API: declare a ``Pipeline``, read with ``connectors.KafkaSource``, transform, key and
process with keyed state, and write with the sinks in ``sinks``.
"""

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
from snapline.pipeline.graph import KeyedStream, Pipeline, Stream
from snapline.pipeline.state.descriptors import (
    AggregateFunction,
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    ValueState,
)
from snapline.pipeline.state.serde import JsonSerde, PickleSerde, Serde

__all__ = [
    "AggregateFunction",
    "AggregatingState",
    "CheckpointError",
    "ConfigurationError",
    "Context",
    "CorruptCheckpointError",
    "JsonSerde",
    "KeyedCoProcessFunction",
    "KeyedProcessFunction",
    "KeyedStream",
    "ListState",
    "MapState",
    "PickleSerde",
    "Pipeline",
    "ReducingState",
    "Serde",
    "SinkError",
    "SinkUnavailableError",
    "SnaplineError",
    "StateError",
    "Stream",
    "ValueState",
]
