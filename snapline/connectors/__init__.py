"""Kafka connectors: the source and admin helpers (local infrastructure lives in `local/`)."""

from typing import Any

from snapline.connectors.kafka_source import KafkaSource

__all__ = ["KafkaSource", "LocalKafkaBroker"]


def __getattr__(name: str) -> Any:
    # The launcher pulls in subprocess/ctypes machinery; import it only when asked for.
    if name == "LocalKafkaBroker":
        from snapline.connectors.local.broker import LocalKafkaBroker

        return LocalKafkaBroker
    raise AttributeError(name)
