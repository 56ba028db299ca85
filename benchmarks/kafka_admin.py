"""Topic creation and deletion for benchmark runs, with bounded waits."""

from __future__ import annotations

import contextlib
import time

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic


class Topics:
    """Creates the topics of a benchmark and deletes them afterwards."""

    def __init__(self, bootstrap: str) -> None:
        # log_level 4: no notices about the partition counts of topics deleted by cleanup
        self._admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 4})
        self.created: list[str] = []

    def create(self, name: str, partitions: int, timeout: float = 60.0,
               config: dict[str, str] | None = None) -> str:
        futures = self._admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1,
                      config=config or {})],
            operation_timeout=timeout, request_timeout=timeout,
        )
        futures[name].result(timeout=timeout)
        self.created.append(name)
        self._wait_for_leaders(name, partitions, timeout)
        return name

    def _wait_for_leaders(self, name: str, partitions: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            meta = self._admin.list_topics(name, timeout=10).topics.get(name)
            if meta is not None and meta.error is None and len(meta.partitions) == partitions \
                    and all(p.leader >= 0 for p in meta.partitions.values()):
                return
            time.sleep(0.1)
        raise KafkaException(f"topic {name} has no leader for all {partitions} partitions "
                             f"after {timeout:.0f}s")

    def partitions(self, name: str) -> int:
        meta = self._admin.list_topics(name, timeout=10).topics.get(name)
        return 0 if meta is None or meta.error is not None else len(meta.partitions)

    def delete(self, names: list[str], timeout: float = 30.0) -> None:
        """Best effort: a benchmark must not fail because a cleanup did."""
        names = [n for n in names if n]
        if not names:
            return
        futures = self._admin.delete_topics(names, operation_timeout=timeout,
                                            request_timeout=timeout)
        for name, future in futures.items():
            with contextlib.suppress(Exception):  # cleanup only
                future.result(timeout=timeout)
            if name in self.created:
                self.created.remove(name)

    def delete_containing(self, marker: str) -> None:
        """Delete every topic whose name contains ``marker`` (changelogs of the peer too)."""
        topics = self._admin.list_topics(timeout=10).topics
        self.delete([t for t in topics if marker in t])
