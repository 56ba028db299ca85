"""The embedded broker of ``snapline run``: a local broker whose data lives beside the job's
checkpoints, so that a job stopped and run again meets the same cluster (same topics, committed
offsets, cluster id and address), as it would in a deployment.

Threads: everything runs in the caller's thread (the main thread of ``snapline run``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from snapline.connectors.local.broker import (
    LocalKafkaBroker,
    ProgressCallback,
    is_broker_process,
    port_accepts,
    read_state,
)
from snapline.pipeline.errors import BrokerError

__all__ = ["EmbeddedBroker", "embedded_data_dir", "start_embedded_broker"]

logger = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path(".snapline") / "kafka"
"""The embedded broker's data dir when the checkpoints are not on a local filesystem."""


def embedded_data_dir(checkpoint_dir: str) -> Path:
    """Where the embedded broker keeps its data for checkpoints in ``checkpoint_dir``.

    Beside a local checkpoint directory (``<parent of checkpoint dir>/kafka``: with the default
    ``.snapline/checkpoints`` that is ``.snapline/kafka``); ``.snapline/kafka`` in the current
    directory for checkpoints in an object store (``s3://``, ``gs://``, ``hdfs://``).
    """
    if "://" in checkpoint_dir:
        parsed = urlparse(checkpoint_dir)
        if parsed.scheme != "file":
            return DEFAULT_DATA_DIR.absolute()
        checkpoint_dir = parsed.path
    return Path(checkpoint_dir).expanduser().absolute().parent / "kafka"


@dataclass(frozen=True)
class EmbeddedBroker:
    """The broker a ``snapline run`` without ``--bootstrap-servers`` uses.

    ``broker`` is set when this run started it (and must stop it); None when it reuses a broker
    started by ``snapline kafka start`` on the same data dir.
    """

    bootstrap_servers: str
    data_dir: Path
    broker: LocalKafkaBroker | None
    description: str


def start_embedded_broker(
    checkpoint_dir: str, *, progress: ProgressCallback | None = None
) -> EmbeddedBroker:
    """Start (or reuse) the embedded broker of checkpoints in ``checkpoint_dir``.

    The data dir is :func:`embedded_data_dir`. A broker that ``snapline kafka start
    --data-dir`` runs on it is reused. Otherwise a broker is started there: on the ports
    remembered from its first start, and on its formatted storage (same cluster id), so the
    job finds its topics and committed offsets. Raises :class:`BrokerError` with the fix when
    that is impossible (the remembered port is taken, another ``snapline run`` owns the broker).
    """
    data_dir = embedded_data_dir(checkpoint_dir)
    recorded = read_state()
    if recorded is not None and Path(recorded.data_dir).resolve() == data_dir.resolve():
        return EmbeddedBroker(
            recorded.bootstrap_servers,
            data_dir,
            None,
            f"embedded Kafka broker at {recorded.bootstrap_servers} (started by `snapline kafka "
            f"start`, pid {recorded.pid}; data {data_dir})",
        )
    _refuse_foreign_owner(data_dir)
    _refuse_taken_ports(data_dir)
    kept = (data_dir / "kraft-logs" / "meta.properties").exists()
    broker = LocalKafkaBroker(data_dir=data_dir, progress=progress)
    bootstrap = broker.start()
    how = "restarted on its kept data" if kept else "new"
    description = f"embedded Kafka broker at {bootstrap} ({how}; data {data_dir})"
    if recorded is not None:
        description += (
            f"; note: `snapline kafka start` runs another broker at "
            f"{recorded.bootstrap_servers}, pass --bootstrap-servers to use that one instead"
        )
    return EmbeddedBroker(bootstrap, data_dir, broker, description)


def _refuse_foreign_owner(data_dir: Path) -> None:
    """A broker of this data dir already runs, owned by another ``snapline run``: stopping that
    run would take the broker away from this one, so share it explicitly instead."""
    try:
        pid = int((data_dir / "broker.pid").read_text().strip())
    except (OSError, ValueError):
        return
    if is_broker_process(pid, data_dir):
        raise BrokerError(
            f"The embedded Kafka broker of {data_dir} already runs (pid {pid}), started by another "
            "`snapline run` that stops it when it ends. Run more workers in that run with "
            "--workers, or start the broker on its own with `snapline kafka start --detach "
            f"--data-dir {data_dir}`: every `snapline run` with these checkpoints then shares it."
        )


def _refuse_taken_ports(data_dir: Path) -> None:
    """The data dir keeps its address across restarts; a port taken by another process is a
    clear error here rather than a broker that comes back somewhere else."""
    try:
        saved = json.loads((data_dir / "ports.json").read_text())
        ports = {"client": int(saved["port"]), "controller": int(saved["controller_port"])}
    except (OSError, ValueError, KeyError, TypeError):
        return  # first start: free ports are chosen and remembered
    for role, port in ports.items():
        if port_accepts(port):
            raise BrokerError(
                f"Port {port} on 127.0.0.1 (the {role} port of the embedded Kafka broker, "
                f"remembered in {data_dir / 'ports.json'}) is in use by another process. The "
                "broker restarts on the same address so that the job and its clients find the "
                f"same cluster. Stop the process listening there (`ss -ltnp 'sport = :{port}'` "
                "names it) and run again, or use another Kafka with --bootstrap-servers. "
                f"Deleting {data_dir} would start an empty cluster on new ports, and the job "
                "would then refuse its checkpoints of the old one."
            )
