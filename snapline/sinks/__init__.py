"""Sinks: the two-phase-commit contract, Kafka, Parquet and PostgreSQL."""

from typing import Any

from snapline.pipeline.sink import Sink, SinkContext, SinkWriter
from snapline.sinks.kafka import KafkaSink
from snapline.sinks.parquet import ParquetSink

__all__ = ["KafkaSink", "ParquetSink", "PostgresSink", "Sink", "SinkContext", "SinkWriter"]


def __getattr__(name: str) -> Any:
    # psycopg is the optional 'postgres' extra: import it only when the sink is used.
    if name == "PostgresSink":
        try:
            from snapline.sinks.postgres import PostgresSink
        except ImportError as exc:
            raise ImportError(
                f"PostgresSink needs psycopg: pip install 'snapline[postgres]' ({exc})"
            ) from exc
        return PostgresSink
    raise AttributeError(name)
