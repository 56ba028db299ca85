"""Kafka connectors: the source, admin helpers and the local broker launcher."""

from typing import Any

from snapline.connectors.kafka_source import KafkaSource

__all__ = ["KafkaSource", "LocalKafkaBroker"]


def __getattr__(name: str) -> Any:
    # The launcher pulls in subprocess/ctypes machinery; import it only when asked for.
    if name == "LocalKafkaBroker":
        from snapline.connectors.local_broker import LocalKafkaBroker

        return LocalKafkaBroker
    raise AttributeError(name)
