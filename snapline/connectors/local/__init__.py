"""Local infrastructure for development and tests: the Kafka broker launcher and PostgreSQL."""

from typing import Any

__all__ = ["LocalKafkaBroker", "LocalKafkaCluster", "LocalPostgres"]


def __getattr__(name: str) -> Any:
    # The launchers pull in subprocess/ctypes machinery; import them only when asked for.
    if name == "LocalKafkaBroker":
        from snapline.connectors.local.broker import LocalKafkaBroker

        return LocalKafkaBroker
    if name == "LocalKafkaCluster":
        from snapline.connectors.local.cluster import LocalKafkaCluster

        return LocalKafkaCluster
    if name == "LocalPostgres":
        from snapline.connectors.local.postgres import LocalPostgres

        return LocalPostgres
    raise AttributeError(name)
