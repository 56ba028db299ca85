"""A local multi-node Kafka cluster: N combined broker+controller KRaft nodes on loopback, each
with its own data dir and ports, a static quorum of every node, and internal and new topics
replicated to 3 nodes with min ISR 2. For tests of broker bounces and for users who want a
cluster that survives one node down.

Threads: everything runs in the caller's thread; as with :class:`LocalKafkaBroker`, nodes
started with ``die_with_parent`` die with the thread that started them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from snapline.connectors.local.broker import (
    TEMP_DIR_PREFIX,
    LocalKafkaBroker,
    ProgressCallback,
    free_ports,
    kafka_version,
    new_cluster_id,
    port_accepts,
)
from snapline.pipeline.errors import BrokerError

__all__ = ["CLUSTER_FILE_NAME", "LocalKafkaCluster"]

logger = logging.getLogger(__name__)

CLUSTER_FILE_NAME = "cluster.json"
"""In the cluster's data dir: cluster id and every node's ports, so a restart keeps them."""


class LocalKafkaCluster:
    """``brokers`` real Kafka nodes (KRaft, broker and controller in each JVM) on 127.0.0.1.

    Example::

        with LocalKafkaCluster(3) as cluster:
            producer = Producer({"bootstrap.servers": cluster.bootstrap_servers})
            cluster.kill_node(2)      # a crash of one node; the others keep serving
            cluster.start_node(2)     # back on the same ports, catches up
            cluster.wait_until_in_sync()

    ``data_dir=None`` uses a temporary directory deleted by :meth:`stop`; a kept ``data_dir``
    keeps the cluster id, topics and ports across restarts (``node-<i>/`` per node). Nodes are
    numbered from 1.
    """

    def __init__(
        self,
        brokers: int = 3,
        version: str | None = None,
        *,
        data_dir: Path | str | None = None,
        heap: str = "384m",
        startup_timeout: float = 120.0,
        die_with_parent: bool = True,
        server_overrides: Mapping[str, str] | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        if brokers < 1:
            raise BrokerError(f"A cluster needs at least 1 broker, got --brokers {brokers}.")
        self.version = kafka_version(version)
        self.size = brokers
        self._requested_data_dir = Path(data_dir).expanduser().resolve() if data_dir else None
        self._heap = heap
        self._startup_timeout = startup_timeout
        self._die_with_parent = die_with_parent
        self._overrides = dict(server_overrides or {})
        self._progress = progress
        self._data_dir: Path | None = None
        self._temporary = False
        self._nodes: dict[int, LocalKafkaBroker] = {}
        self._ports: dict[int, tuple[int, int]] = {}
        self.cluster_id: str | None = None

    # -- properties

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise BrokerError("The local Kafka cluster is not started; call start() first.")
        return self._data_dir

    @property
    def node_ids(self) -> list[int]:
        return list(range(1, self.size + 1))

    @property
    def bootstrap_servers(self) -> str:
        """Every node's client address, comma-separated (valid whichever nodes are down)."""
        if not self._ports:
            raise BrokerError("The local Kafka cluster is not started; call start() first.")
        return ",".join(self.node_address(i) for i in self.node_ids)

    def node_address(self, node_id: int) -> str:
        return f"127.0.0.1:{self._ports[node_id][0]}"

    def node(self, node_id: int) -> LocalKafkaBroker:
        """The launcher of one node (its ``pid``, ``log_path``, ``data_dir``)."""
        if node_id not in self._nodes:
            raise BrokerError(f"No node {node_id} in a cluster of nodes {self.node_ids}.")
        return self._nodes[node_id]

    @property
    def temporary(self) -> bool:
        """Whether the data dir is a temporary one, deleted by :meth:`stop`."""
        return self._temporary

    @property
    def pid(self) -> int | None:
        """Node 1's JVM (what ``snapline kafka status`` shows first)."""
        return self.node(1).pid

    @property
    def log_path(self) -> Path:
        """Node 1's ``server.log``; :attr:`log_paths` has every node's."""
        return self.node(1).log_path

    @property
    def log_paths(self) -> list[Path]:
        return [self._nodes[i].log_path for i in self.node_ids]

    def running_nodes(self) -> list[int]:
        return [i for i in self.node_ids if self._nodes.get(i) and self._nodes[i].running]

    @property
    def running(self) -> bool:
        return bool(self._nodes) and len(self.running_nodes()) == self.size

    # -- the whole cluster

    def start(self) -> str:
        """Start every node that is not running (all at once: the quorum needs a majority) and
        wait until each serves; returns the bootstrap servers."""
        self._prepare()
        down = [i for i in self.node_ids if not self._nodes[i].running]
        deadline = time.monotonic() + self._startup_timeout
        try:
            addresses = {i: self._nodes[i].launch() for i in down}
            for i in down:
                self._nodes[i].wait_until_ready(addresses[i], deadline)
        except BaseException:
            for i in down:
                self._nodes[i].kill()
            raise
        logger.info(
            "Local Kafka cluster of %d nodes ready at %s", self.size, self.bootstrap_servers
        )
        return self.bootstrap_servers

    def stop(self, timeout: float = 30.0) -> None:
        """Shut every node down cleanly (SIGTERM; SIGKILL after ``timeout`` s). A temporary
        data dir is deleted; calling stop twice is harmless."""
        # All at once: stopped one by one, the last node waits for a controller quorum that
        # is already gone and only ends at SIGKILL. Each node's broker part shuts down before
        # its controller part, so the quorum outlives the brokers' controlled shutdown.
        nodes = [self._nodes[i] for i in self.node_ids if i in self._nodes]
        for node in nodes:
            node.request_stop()
        for node in nodes:
            node.stop(timeout)
        if self._temporary and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL every node at once (a whole-cluster crash)."""
        for i in self.node_ids:
            if i in self._nodes:
                self._nodes[i].kill()

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until some node exits (its exit code) or ``timeout`` passes (None)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for i in self.node_ids:
                code = self._nodes[i].wait(0) if i in self._nodes else None
                if code is not None:
                    return code
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    # -- one node (rolling bounces)

    def stop_node(self, node_id: int, timeout: float = 30.0) -> None:
        """Controlled shutdown of one node: it moves its leaderships away first."""
        self.node(node_id).stop(timeout)

    def kill_node(self, node_id: int) -> None:
        """SIGKILL one node (a crash)."""
        self.node(node_id).kill()

    def start_node(self, node_id: int) -> None:
        """Start one node again on its ports and data, and wait until it serves."""
        node = self.node(node_id)
        if node.running:
            return
        address = node.launch()
        node.wait_until_ready(address, time.monotonic() + self._startup_timeout)

    def restart_node(self, node_id: int, *, kill: bool = False) -> None:
        """Stop (or SIGKILL) one node and start it again."""
        if kill:
            self.kill_node(node_id)
        else:
            self.stop_node(node_id)
        self.start_node(node_id)

    def wait_until_in_sync(self, timeout: float = 120.0) -> None:
        """Until every replica of every partition is in its ISR (no under-replicated partition):
        what a rolling restart waits for before it bounces the next node."""
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "logger": logger})
        deadline = time.monotonic() + timeout
        lagging: list[str] = []
        while True:
            try:
                topics = admin.list_topics(timeout=10).topics
                lagging = [
                    f"{name}-{p.id}"
                    for name, topic in topics.items()
                    for p in topic.partitions.values()
                    if p.leader < 0 or set(p.isrs) != set(p.replicas)
                ]
                if not lagging:
                    return
            except KafkaException as exc:
                lagging = [str(exc)]
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"The local Kafka cluster did not get every replica in sync within "
                    f"{timeout:.0f} s; still lagging: {lagging[:10]}. Logs: {self.log_paths}"
                )
            time.sleep(0.5)

    # -- context manager

    def __enter__(self) -> LocalKafkaCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.bootstrap_servers if self._ports else "not started"
        return f"LocalKafkaCluster({self.size} nodes, version={self.version!r}, {where})"

    # -- setup

    def _prepare(self) -> None:
        if self._nodes:
            return
        if self._requested_data_dir is not None:
            self._requested_data_dir.mkdir(parents=True, exist_ok=True)
            self._data_dir, self._temporary = self._requested_data_dir, False
        else:
            self._data_dir = Path(tempfile.mkdtemp(prefix=f"{TEMP_DIR_PREFIX}cluster-"))
            self._temporary = True
            # While this process lives, the dir is not swept as orphaned, even with every node
            # down (a whole-cluster bounce).
            (self._data_dir / "owner.pid").write_text(str(os.getpid()))
        self._load_or_choose_layout()
        voters = ",".join(f"{i}@127.0.0.1:{self._ports[i][1]}" for i in self.node_ids)
        for i in self.node_ids:
            port, controller_port = self._ports[i]
            self._nodes[i] = LocalKafkaBroker(
                self.version,
                data_dir=self._data_dir / f"node-{i}",
                port=port,
                controller_port=controller_port,
                heap=self._heap,
                startup_timeout=self._startup_timeout,
                die_with_parent=self._die_with_parent,
                server_overrides=self._overrides,
                progress=self._progress,
                node_id=i,
                cluster_id=self.cluster_id,
                quorum_voters=voters,
            )

    def _load_or_choose_layout(self) -> None:
        assert self._data_dir is not None
        layout = self._data_dir / CLUSTER_FILE_NAME
        if layout.exists():
            try:
                saved = json.loads(layout.read_text("utf-8"))
                ports = {int(k): (int(v[0]), int(v[1])) for k, v in saved["ports"].items()}
                cluster_id = str(saved["cluster_id"])
            except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                raise BrokerError(
                    f"{layout} is unreadable ({exc}); delete {self._data_dir} to start an empty "
                    "cluster."
                ) from exc
            if sorted(ports) != self.node_ids:
                raise BrokerError(
                    f"{self._data_dir} holds a cluster of {len(ports)} nodes, not {self.size}; "
                    f"start it with --brokers {len(ports)}, or choose another --data-dir."
                )
            for node_id, (port, controller_port) in ports.items():
                for candidate in (port, controller_port):
                    if port_accepts(candidate):
                        raise BrokerError(
                            f"Port {candidate} of node {node_id} (remembered in {layout}) is in "
                            "use by another process; stop it (`ss -ltnp 'sport = :"
                            f"{candidate}'` names it) and retry."
                        )
            self._ports, self.cluster_id = ports, cluster_id
            return
        free = free_ports(2 * self.size)
        self._ports = {i: (free[2 * (i - 1)], free[2 * (i - 1) + 1]) for i in self.node_ids}
        self.cluster_id = new_cluster_id()
        layout.write_text(
            json.dumps({"cluster_id": self.cluster_id, "ports": self._ports}, indent=1), "utf-8"
        )
