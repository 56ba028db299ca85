"""Snapline: exactly-once stream pipelines on Apache Kafka.

Public API: declare a ``Pipeline``, read with ``connectors.KafkaSource``, transform, key and
process with keyed state, and write with the sinks in ``sinks``.
"""

from pipeline.errors import (
    CheckpointError,
    ConfigurationError,
    CorruptCheckpointError,
    SinkError,
    SnaplineError,
    StateError,
)
from pipeline.functions import Context, KeyedProcessFunction
from pipeline.graph import KeyedStream, Pipeline, Stream
from pipeline.state.descriptors import (
    AggregateFunction,
    AggregatingState,
    ListState,
    MapState,
    ReducingState,
    ValueState,
)
from pipeline.state.serde import JsonSerde, PickleSerde, Serde

__all__ = [
    "AggregateFunction",
    "AggregatingState",
    "CheckpointError",
    "ConfigurationError",
    "Context",
    "CorruptCheckpointError",
    "JsonSerde",
    "KeyedProcessFunction",
    "KeyedStream",
    "ListState",
    "MapState",
    "PickleSerde",
    "Pipeline",
    "ReducingState",
    "Serde",
    "SinkError",
    "SnaplineError",
    "StateError",
    "Stream",
    "ValueState",
]
