"""Sinks: the two-phase-commit contract, Kafka, Parquet and PostgreSQL."""

from sinks.base import Sink, SinkContext, SinkWriter
from sinks.kafka import KafkaSink

__all__ = ["KafkaSink", "Sink", "SinkContext", "SinkWriter"]
