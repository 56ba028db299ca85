"""Sinks: the two-phase-commit contract, Kafka, Parquet and PostgreSQL."""

from typing import TYPE_CHECKING, Any

from snapline.pipeline.sink import Sink, SinkContext, SinkWriter
from snapline.sinks.kafka import KafkaSink

if TYPE_CHECKING:  # imported on first use (__getattr__ below)
    from snapline.sinks.parquet import ParquetSink

__all__ = ["KafkaSink", "ParquetSink", "PostgresSink", "Sink", "SinkContext", "SinkWriter"]


def __getattr__(name: str) -> Any:
    # pyarrow (Parquet) is imported only when the sink is used: it is most of a worker's
    # import time. psycopg is the optional 'postgres' extra.
    if name == "ParquetSink":
        from snapline.sinks.parquet import ParquetSink

        return ParquetSink
    if name == "PostgresSink":
        try:
            from snapline.sinks.postgres import PostgresSink
        except ImportError as exc:
            raise ImportError(
                f"PostgresSink needs psycopg: pip install 'snapline[postgres]' ({exc})"
            ) from exc
        return PostgresSink
    raise AttributeError(name)
