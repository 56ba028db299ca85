"""The local Kafka broker: a real single-node KRaft Apache Kafka from Maven Central jars,
cached per user and started on free loopback ports. It is the embedded default of
``snapline run`` and the broker of the integration tests.

Threads: everything runs in the caller's thread. With ``die_with_parent`` (the default) the
broker is killed when the *thread* that started it exits (Linux ``PR_SET_PDEATHSIG``
semantics), so start it from the main thread or from a thread that outlives it.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from types import TracebackType

from snapline.pipeline.errors import BrokerError

__all__ = [
    "DEFAULT_KAFKA_VERSION",
    "BrokerState",
    "LocalKafkaBroker",
    "broker_answers",
    "cache_dir",
    "ensure_kafka_jars",
    "find_java",
    "find_maven",
    "jars_are_complete",
    "kafka_version",
    "libs_dir",
    "port_accepts",
    "read_state",
    "render_server_properties",
    "stop_recorded_broker",
    "transaction_marker_defect",
]

logger = logging.getLogger(__name__)

DEFAULT_KAFKA_VERSION = "4.2.1"
"""The newest release without KAFKA-20734 (see :func:`transaction_marker_defect`). 4.3.0 and
4.3.1 have it; 4.4.0 does not resolve on Maven Central (it lacks kafka-tools-api)."""

_MARKER_DEFECT = (
    "Kafka {version} has KAFKA-20734: after a broker restart its transaction coordinator can "
    "skip the COMMIT or ABORT markers of a transaction whose partitions have no leader yet "
    "(it takes them for deleted topics). The transaction then hangs: read_committed readers "
    "and committed offsets stop at it for good, or a later COMMIT of the same producer makes "
    "aborted records visible. Use Kafka {default} (Snapline's default; unset "
    "SNAPLINE_KAFKA_VERSION) for exactly-once pipelines."
)

MIN_JAVA_VERSION = 17
MARKER_NAME = ".snapline-complete"
STATE_FILE_NAME = "broker.json"
TEMP_DIR_PREFIX = "snapline-kafka-"

ProgressCallback = Callable[[str], None]

_VERSION_RE = re.compile(r"^\d+\.\d+\.\d+(?:[.-][A-Za-z0-9]+)*$")
_JAVA_VERSION_RE = re.compile(r'version "(\d+)(?:\.(\d+))?[^"]*"')
_MAVEN_TRANSFER_RE = re.compile(
    r"^(?:\[INFO\] )?(Downloading|Downloaded) from [^:]+: (\S+)(?: \((.*)\))?"
)
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_INSTALL_JAVA = "apt-get install openjdk-17-jre-headless"
_INSTALL_MAVEN = "apt-get install maven"
_USE_EXISTING = "or point Snapline at an existing cluster with SNAPLINE_BOOTSTRAP_SERVERS"


# --------------------------------------------------------------------------- locations


def kafka_version(version: str | None = None) -> str:
    """The Kafka release to use: ``version``, else ``$SNAPLINE_KAFKA_VERSION``, else the default."""
    chosen = version or os.environ.get("SNAPLINE_KAFKA_VERSION") or DEFAULT_KAFKA_VERSION
    if not _VERSION_RE.match(chosen):
        raise BrokerError(
            f"Kafka version {chosen!r} is not a release number like {DEFAULT_KAFKA_VERSION!r}; "
            "fix SNAPLINE_KAFKA_VERSION (or unset it to use the default)."
        )
    return chosen


def transaction_marker_defect(version: str) -> str | None:
    """Why Kafka ``version`` can leave transactions hanging after a broker crash, or None.

    Kafka 4.3 ported ``KRaftMetadataCache`` from Scala to Java, and its
    ``getPartitionLeaderEndpoint`` now answers "no endpoint" for a partition whose leader is
    offline, where 4.2 answered "unknown node". The transaction marker sender reads "no
    endpoint" as "topic deleted" and drops the partition from the transaction (KAFKA-5202's
    skip) instead of queueing its marker until a leader appears (KAFKA-20734, open when 4.3.1
    shipped). On one node every partition is leaderless while a restarted broker waits for
    its old registration to be fenced, so a broker crash between a transaction's
    ``PrepareCommit`` and its markers often leaves it hanging
    (``integration_tests/test_broker_crash_after_commit.py``). Releases from 4.3.0 on are
    named until one is measured without it.
    """
    parts = re.match(r"^(\d+)\.(\d+)\.", version)
    if parts is None or (int(parts[1]), int(parts[2])) < (4, 3):
        return None
    return _MARKER_DEFECT.format(version=version, default=DEFAULT_KAFKA_VERSION)


def cache_dir() -> Path:
    """Snapline's per-user cache: ``$SNAPLINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/snapline``,
    else ``~/.cache/snapline``."""
    override = os.environ.get("SNAPLINE_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "snapline"


def kafka_home(version: str | None = None) -> Path:
    """Cache directory of one Kafka release (pom, libs/)."""
    return cache_dir() / "kafka" / kafka_version(version)


def libs_dir(version: str | None = None) -> Path:
    """Where the jars of one Kafka release live once downloaded."""
    return kafka_home(version) / "libs"


def state_file() -> Path:
    """Record of the broker started by ``snapline kafka start`` (found by status and stop)."""
    return cache_dir() / "kafka" / STATE_FILE_NAME


# --------------------------------------------------------------------------- prerequisites


def parse_java_version(text: str) -> int | None:
    """Major version from ``java -version`` output (``"1.8.0_292"`` is 8, ``"17.0.15"`` is 17)."""
    match = _JAVA_VERSION_RE.search(text)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2) is not None:
        return int(match.group(2))
    return major


def _java_candidates() -> list[str]:
    found: list[str] = []
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            found.append(str(candidate))
    on_path = shutil.which("java")
    if on_path:
        found.append(on_path)
    return found


def find_java() -> str:
    """Path of a Java 17+ executable (``$JAVA_HOME/bin/java`` first, then ``PATH``)."""
    candidates = _java_candidates()
    if not candidates:
        raise BrokerError(
            f"Java {MIN_JAVA_VERSION}+ is needed to run the local Kafka broker and none was found "
            f"(no $JAVA_HOME/bin/java, no `java` on PATH). Install it with `{_INSTALL_JAVA}`, "
            f"set JAVA_HOME, {_USE_EXISTING}."
        )
    seen: list[str] = []
    for java in candidates:
        try:
            result = subprocess.run(
                [java, "-version"], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            seen.append(f"{java}: {exc}")
            continue
        major = parse_java_version(result.stderr + result.stdout)
        if major is not None and major >= MIN_JAVA_VERSION:
            return java
        seen.append(f"{java}: version {major if major is not None else 'unknown'}")
    raise BrokerError(
        f"Java {MIN_JAVA_VERSION}+ is needed to run the local Kafka broker, found only "
        f"{'; '.join(seen)}. Install it with `{_INSTALL_JAVA}` and put it first on PATH or in "
        f"JAVA_HOME, {_USE_EXISTING}."
    )


def find_maven() -> str:
    """Path of ``mvn``, which resolves the broker's jars from Maven Central."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(
            "Maven (`mvn`) is needed once to download the Kafka broker jars and is not on PATH. "
            f"Install it with `{_INSTALL_MAVEN}`, {_USE_EXISTING}."
        )
    return mvn


# --------------------------------------------------------------------------- jar cache


def render_pom(version: str) -> str:
    """The Maven project whose runtime dependencies are the broker's classpath."""
    template = (
        resources.files("snapline.connectors.local").joinpath("kafka/pom.xml").read_text("utf-8")
    )
    return template.replace("@KAFKA_VERSION@", kafka_version(version))


def jars_are_complete(libs: Path) -> bool:
    """True when a finished download left its marker and every jar it lists still exists."""
    marker = libs / MARKER_NAME
    try:
        recorded = json.loads(marker.read_text("utf-8"))
    except (OSError, ValueError):
        return False
    jars = recorded.get("jars") if isinstance(recorded, dict) else None
    if not isinstance(jars, list) or not jars:
        return False
    return all((libs / str(name)).is_file() for name in jars)


def write_completion_marker(libs: Path, version: str) -> None:
    """Declare ``libs`` complete; written last, so an interrupted download is redone."""
    jars = sorted(p.name for p in libs.glob("*.jar"))
    record = {"version": version, "jars": jars, "completed_at": _now()}
    tmp = libs / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps(record, indent=1), "utf-8")
    tmp.replace(libs / MARKER_NAME)


def condense_maven_line(line: str) -> str | None:
    """A short progress message for a line of Maven output, or None for noise.

    ``[INFO] Downloading from central: https://.../kafka_2.13-4.3.1.jar`` becomes
    ``downloading kafka_2.13-4.3.1.jar``.
    """
    line = _ANSI_RE.sub("", line).strip()
    match = _MAVEN_TRANSFER_RE.match(line)
    if match is not None:
        verb, url, detail = match.groups()
        name = url.rsplit("/", 1)[-1]
        size = f" ({detail.split(' at ')[0]})" if detail else ""
        return f"{verb.lower()} {name}{size}"
    if line.startswith("[ERROR]"):
        return line
    return None


def _maven_failure_lines(lines: deque[str], limit: int = 15) -> list[str]:
    errors = [line for line in lines if line.startswith("[ERROR]") and line.strip() != "[ERROR]"]
    picked = errors or list(lines)
    return picked[:limit] if errors else picked[-limit:]


def ensure_kafka_jars(version: str | None = None, progress: ProgressCallback | None = None) -> Path:
    """The directory holding every jar of Kafka ``version``, downloaded with Maven if needed.

    The cache is shared by all later runs; ``progress`` receives short messages (one per
    artifact transfer) while Maven downloads. Concurrent callers wait for each other.
    """
    version = kafka_version(version)
    libs = libs_dir(version)
    if jars_are_complete(libs):
        return libs
    home = libs.parent
    home.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(home / ".lock"):
        if jars_are_complete(libs):  # another process finished while we waited
            return libs
        mvn = find_maven()
        find_java()  # Maven needs it too, and its own error is less clear
        if libs.exists():
            logger.info("Removing incomplete Kafka download in %s", libs)
            shutil.rmtree(libs)
        pom = home / "pom.xml"
        pom.write_text(render_pom(version), "utf-8")
        logger.info("Downloading Kafka %s jars with Maven into %s (first run only)", version, libs)
        _run_maven(mvn, pom, libs, version, progress)
        if not (libs / f"kafka_2.13-{version}.jar").is_file():
            raise BrokerError(
                f"Maven finished but {libs} has no kafka_2.13-{version}.jar; delete {home} and "
                "retry, or pick another release with SNAPLINE_KAFKA_VERSION."
            )
        write_completion_marker(libs, version)
    return libs


def _run_maven(
    mvn: str, pom: Path, libs: Path, version: str, progress: ProgressCallback | None
) -> None:
    command = [
        mvn,
        "-B",
        "-Dstyle.color=never",
        "-f",
        str(pom),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={libs}",
    ]
    tail: deque[str] = deque(maxlen=400)
    try:
        process = subprocess.Popen(
            command,
            cwd=pom.parent,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise BrokerError(
            f"Could not run Maven ({mvn}): {exc}. Reinstall it: `{_INSTALL_MAVEN}`."
        ) from exc
    assert process.stdout is not None
    with process:
        for raw in process.stdout:
            line = _ANSI_RE.sub("", raw.rstrip("\n"))
            tail.append(line)
            message = condense_maven_line(line)
            if message is not None:
                logger.debug("maven: %s", message)
                if progress is not None:
                    progress(message)
    if process.returncode != 0:
        shown = "\n  ".join(_maven_failure_lines(tail))
        raise BrokerError(
            f"Maven could not download Kafka {version} (exit code {process.returncode}):\n  "
            f"{shown}\nCheck network access to Maven Central (https://repo.maven.apache.org) "
            "and any proxy in ~/.m2/settings.xml, or choose a release that resolves with "
            f"SNAPLINE_KAFKA_VERSION={DEFAULT_KAFKA_VERSION}; then run `snapline kafka fetch`."
        )


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- broker config


def render_server_properties(
    *,
    port: int,
    controller_port: int,
    log_dirs: Path | str,
    node_id: int = 1,
    quorum_voters: str | None = None,
    overrides: Mapping[str, str] | None = None,
) -> str:
    """``server.properties`` of a combined broker+controller KRaft node on 127.0.0.1.

    Alone (``quorum_voters=None``) the node is its own quorum; in a cluster
    (``quorum_voters="1@127.0.0.1:<port>,2@..."``, see :class:`LocalKafkaCluster`) the voters
    are static and internal topics are replicated to 3 nodes with min ISR 2.
    """
    listeners = f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}"
    quorum = (
        {"controller.quorum.voters": quorum_voters}
        if quorum_voters
        else {"controller.quorum.bootstrap.servers": f"127.0.0.1:{controller_port}"}
    )
    settings: dict[str, str] = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        **quorum,
        "listeners": listeners,
        "advertised.listeners": listeners,
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(log_dirs),
        "num.partitions": "1",
        # A single node: every internal topic has one replica; one partition starts faster.
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "group.initial.rebalance.delay.ms": "0",
        # A mistyped topic name must fail, not silently create an empty topic.
        "auto.create.topics.enable": "false",
    }
    if quorum_voters:
        replicas = str(min(3, quorum_voters.count("@")))
        min_isr = str(max(1, int(replicas) - 1))
        settings.update(
            {
                # Every partition survives one node down and acknowledges a write only once
                # two nodes hold it (acks=all, which transactional producers use).
                "offsets.topic.replication.factor": replicas,
                "transaction.state.log.replication.factor": replicas,
                "transaction.state.log.min.isr": min_isr,
                "default.replication.factor": replicas,
                "min.insync.replicas": min_isr,
                "unclean.leader.election.enable": "false",
            }
        )
    if overrides:
        settings.update({str(k): str(v) for k, v in overrides.items()})
    lines = ["# Written by Snapline's local broker launcher (connectors/local/broker.py)."]
    lines += [f"{key}={value}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def new_cluster_id() -> str:
    """A KRaft cluster id: a random UUID in URL-safe base64 without padding.

    Like Kafka's ``Uuid.randomUuid`` it never starts with ``-``, which command lines would
    read as an option.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_accepts(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port`` right now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def broker_answers(bootstrap: str, timeout: float) -> bool:
    """Whether a Kafka cluster at ``bootstrap`` returns metadata naming at least one broker."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": logger})
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException:
        return False
    return bool(metadata.brokers)


def node_serves(bootstrap: str, node_id: int, timeout: float) -> bool:
    """Whether the cluster at ``bootstrap`` lists node ``node_id`` as a live broker."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": logger})
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException:
        return False
    return node_id in metadata.brokers


def tail_lines(path: Path, count: int = 25) -> list[str]:
    """The last ``count`` lines of a text file ([] if it does not exist)."""
    try:
        with path.open("r", encoding="utf-8", errors="replace") as handle:
            return list(deque((line.rstrip("\n") for line in handle), maxlen=count))
    except OSError:
        return []


# --------------------------------------------------------------------------- process control


# Runs between fork and java: asks the kernel to SIGKILL this process when the thread that
# started it dies (PR_SET_PDEATHSIG survives exec), then becomes java. A wrapper instead of a
# preexec_fn, which is unsafe when the launching process already runs threads (librdkafka).
_WATCHDOG = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)\n"  # PR_SET_PDEATHSIG, SIGKILL
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"  # the parent died before prctl
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_watchdog(command: list[str]) -> list[str]:
    """``command`` wrapped so that it is killed when this process dies (Linux; else unchanged)."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return command
    return [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), *command]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        with contextlib.suppress(OSError, IndexError):
            # A zombie has exited; it only waits for its parent to reap it.
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def is_broker_process(pid: int, data_dir: Path | str) -> bool:
    """Whether ``pid`` is the live java process of the broker whose data dir is ``data_dir``."""
    if not _pid_alive(pid):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():  # no procfs: trust the pid
        return True
    try:
        args = cmdline.read_bytes().decode("utf-8", "replace").split("\0")
    except OSError:
        return False
    return "kafka.Kafka" in args and str(Path(data_dir) / "server.properties") in args


def terminate_pid(pid: int, grace: float = 20.0) -> None:
    """SIGTERM ``pid`` (graceful Kafka shutdown), SIGKILL it after ``grace`` s; wait until gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            logger.warning("Kafka broker pid %d ignored SIGTERM for %.0f s; killing it", pid, grace)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10.0
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            return
        time.sleep(0.05)


def _sweep_orphaned_data_dirs() -> None:
    """Delete temporary data dirs whose broker died without cleaning up (e.g. SIGKILL)."""
    for path in Path(tempfile.gettempdir()).glob(f"{TEMP_DIR_PREFIX}*"):
        try:  # a LocalKafkaCluster's launcher may restart its nodes: not orphaned yet
            if _pid_alive(int((path / "owner.pid").read_text().strip())):
                continue
        except (OSError, ValueError):
            pass
        # a single broker's pid file, or each node's of a LocalKafkaCluster
        pid_files = [path / "broker.pid"] if (path / "broker.pid").exists() else []
        pid_files = pid_files or sorted(path.glob("node-*/broker.pid"))
        try:
            pids = [int(f.read_text().strip()) for f in pid_files]
        except (OSError, ValueError):
            continue  # still starting, or not ours
        if pids and not any(_pid_alive(pid) for pid in pids):
            logger.debug("Removing orphaned broker data dir %s", path)
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- the broker


@dataclass(frozen=True)
class BrokerState:
    """What ``snapline kafka status/stop`` need to find a broker started by another process."""

    pid: int
    bootstrap_servers: str
    log_path: str
    data_dir: str
    temporary: bool
    version: str
    started_at: str
    detached: bool
    #: the other nodes of a ``--brokers N`` cluster: (pid, data dir) each
    other_nodes: tuple[tuple[int, str], ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> BrokerState:
        raw = json.loads(text)
        return cls(
            pid=int(raw["pid"]),
            bootstrap_servers=str(raw["bootstrap_servers"]),
            log_path=str(raw["log_path"]),
            data_dir=str(raw["data_dir"]),
            temporary=bool(raw["temporary"]),
            version=str(raw["version"]),
            started_at=str(raw["started_at"]),
            detached=bool(raw["detached"]),
            other_nodes=tuple((int(p), str(d)) for p, d in raw.get("other_nodes", ())),
        )


class LocalKafkaBroker:
    """A real single-node Apache Kafka (KRaft) on 127.0.0.1, for development and tests.

    Example::

        with LocalKafkaBroker() as broker:
            producer = Producer({"bootstrap.servers": broker.bootstrap_servers})

    The first start downloads the jars (about 45 MB) with Maven into the per-user cache.
    ``data_dir=None`` uses a fresh temporary directory, deleted by :meth:`stop`. With
    ``die_with_parent`` the broker never outlives this process: it is stopped at exit and
    killed by the kernel if this process dies first. ``LocalKafkaBroker(die_with_parent=False)``
    is for ``snapline kafka start --detach``, where outliving the launcher is the point.
    """

    def __init__(
        self,
        version: str | None = None,
        *,
        data_dir: Path | str | None = None,
        port: int | None = None,
        controller_port: int | None = None,
        heap: str = "512m",
        startup_timeout: float = 60.0,
        die_with_parent: bool = True,
        server_overrides: Mapping[str, str] | None = None,
        progress: ProgressCallback | None = None,
        node_id: int = 1,
        cluster_id: str | None = None,
        quorum_voters: str | None = None,
    ) -> None:
        self.version = kafka_version(version)
        self.node_id = node_id
        self._cluster_id = cluster_id
        self._quorum_voters = quorum_voters
        self._requested_data_dir = Path(data_dir).expanduser().resolve() if data_dir else None
        self._requested_port = port
        self._requested_controller_port = controller_port
        self._heap = heap
        self._startup_timeout = startup_timeout
        self._die_with_parent = die_with_parent
        self._overrides = dict(server_overrides or {})
        self._progress = progress
        self._process: subprocess.Popen[bytes] | None = None
        self._data_dir: Path | None = None
        self._temporary = False
        self._bootstrap: str | None = None
        self._started_at: str | None = None

    # -- properties

    @property
    def bootstrap_servers(self) -> str:
        """``127.0.0.1:<port>`` of the running broker."""
        if self._bootstrap is None:
            raise BrokerError("The local Kafka broker is not started; call start() first.")
        return self._bootstrap

    @property
    def data_dir(self) -> Path:
        """Where the broker keeps its config, logs and topic data."""
        if self._data_dir is None:
            raise BrokerError("The local Kafka broker is not started; call start() first.")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """The broker's ``server.log`` (read it when something fails)."""
        return self.data_dir / "server.log"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def state(self, *, detached: bool) -> BrokerState:
        """A record of this running broker for the state file."""
        if self._process is None or self._bootstrap is None or self._data_dir is None:
            raise BrokerError("The local Kafka broker is not started; call start() first.")
        return BrokerState(
            pid=self._process.pid,
            bootstrap_servers=self._bootstrap,
            log_path=str(self.log_path),
            data_dir=str(self._data_dir),
            temporary=self._temporary,
            version=self.version,
            started_at=self._started_at or _now(),
            detached=detached,
        )

    # -- lifecycle

    def start(self) -> str:
        """Provision and start the broker; returns its bootstrap address once it serves metadata."""
        if self.running and self._bootstrap is not None:
            return self._bootstrap
        bootstrap = self.launch()
        self.wait_until_ready(bootstrap)
        return bootstrap

    def launch(self) -> str:
        """Provision and start the JVM without waiting for it to serve; returns its address.

        A node of a cluster cannot serve until a majority of the quorum runs, so
        :class:`LocalKafkaCluster` launches every node first, then waits for each.
        """
        java = find_java()
        defect = transaction_marker_defect(self.version)
        if defect:
            logger.warning(defect)
        libs = ensure_kafka_jars(self.version, self._progress)
        _sweep_orphaned_data_dirs()
        data_dir = self._prepare_data_dir()
        try:
            port, controller_port = self._choose_ports()
            self._write_config(data_dir, port, controller_port)
            self._format_storage(java, libs, data_dir)
            self._launch(java, libs, data_dir)
        except BaseException:
            self._kill_after_failed_start()
            raise
        return f"127.0.0.1:{port}"

    def wait_until_ready(self, bootstrap: str, deadline: float | None = None) -> None:
        """Block until the launched node serves metadata at ``bootstrap`` (or fail with its log)."""
        try:
            self._wait_until_ready(bootstrap, deadline)
        except BaseException:
            self._kill_after_failed_start()
            raise
        self._bootstrap = bootstrap
        self._started_at = _now()
        logger.info("Local Kafka %s ready at %s (log %s)", self.version, bootstrap, self.log_path)

    def request_stop(self) -> None:
        """Send SIGTERM (controlled shutdown) without waiting; :meth:`stop` then waits."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()

    def kill(self) -> None:
        """SIGKILL the broker (a crash: no controlled shutdown) and wait until it is gone."""
        process, self._process = self._process, None
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        self._bootstrap = None

    def stop(self, timeout: float = 20.0) -> None:
        """Shut the broker down (SIGTERM, SIGKILL after ``timeout`` s) and wait until it is gone.

        A temporary data dir is deleted; calling stop twice is harmless.
        """
        process, self._process = self._process, None
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("Local Kafka ignored SIGTERM for %.0f s; killing it", timeout)
                process.kill()
                process.wait()
        self._bootstrap = None
        if self._temporary and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the broker exits (its exit code) or ``timeout`` passes (None)."""
        if self._process is None:
            return None
        try:
            return self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> LocalKafkaBroker:
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
        where = self._bootstrap or "not started"
        return f"LocalKafkaBroker(version={self.version!r}, {where})"

    # -- steps of start()

    def _prepare_data_dir(self) -> Path:
        if self._requested_data_dir is not None:
            self._requested_data_dir.mkdir(parents=True, exist_ok=True)
            self._data_dir, self._temporary = self._requested_data_dir, False
        else:
            self._data_dir = Path(tempfile.mkdtemp(prefix=TEMP_DIR_PREFIX))
            self._temporary = True
        return self._data_dir

    def _choose_ports(self) -> tuple[int, int]:
        port, controller_port = self._requested_port, self._requested_controller_port
        assert self._data_dir is not None
        remembered = self._data_dir / "ports.json"
        if not self._temporary and remembered.exists() and port is None:
            # A kept data dir keeps its address, so clients and the KRaft voter record match.
            with contextlib.suppress(OSError, ValueError, KeyError):
                saved = json.loads(remembered.read_text())
                port, controller_port = int(saved["port"]), int(saved["controller_port"])
        if port is None or controller_port is None:
            fresh = free_ports(2)
            port = port if port is not None else fresh[0]
            controller_port = controller_port if controller_port is not None else fresh[1]
        for candidate in (port, controller_port):
            if port_accepts(candidate):
                raise BrokerError(
                    f"Port {candidate} on 127.0.0.1 is already in use; choose another with "
                    "--port, or stop what listens there (`snapline kafka status`)."
                )
        if not self._temporary:
            remembered.write_text(json.dumps({"port": port, "controller_port": controller_port}))
        return port, controller_port

    def _write_config(self, data_dir: Path, port: int, controller_port: int) -> None:
        (data_dir / "server.properties").write_text(
            render_server_properties(
                port=port,
                controller_port=controller_port,
                log_dirs=data_dir / "kraft-logs",
                node_id=self.node_id,
                quorum_voters=self._quorum_voters,
                overrides=self._overrides,
            ),
            "utf-8",
        )
        template = resources.files("snapline.connectors.local").joinpath("kafka/log4j2.properties")
        (data_dir / "log4j2.properties").write_text(template.read_text("utf-8"), "utf-8")

    def _java_command(self, java: str, libs: Path, data_dir: Path, log_file: Path) -> list[str]:
        return [
            java,
            f"-Xmx{self._heap}",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={data_dir / 'log4j2.properties'}",
            f"-Dsnapline.log.file={log_file}",
            "-cp",
            f"{libs}/*",
        ]

    def _format_storage(self, java: str, libs: Path, data_dir: Path) -> None:
        if (data_dir / "kraft-logs" / "meta.properties").exists():
            return  # a kept data dir: formatting again would need its original cluster id
        # A cluster's voters are static (in server.properties); a single node is its own quorum.
        quorum = [] if self._quorum_voters else ["--standalone"]
        command = self._java_command(java, libs, data_dir, data_dir / "storage-format.log") + [
            "kafka.tools.StorageTool",
            "format",
            *quorum,
            "-t",
            self._cluster_id or new_cluster_id(),
            "-c",
            str(data_dir / "server.properties"),
        ]
        try:
            result = subprocess.run(
                command,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=120,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise BrokerError(
                f"Formatting the Kafka storage in {data_dir} took over 120 s; the machine may be "
                "overloaded. Retry, or use an existing cluster (SNAPLINE_BOOTSTRAP_SERVERS)."
            ) from exc
        if result.returncode != 0:
            output = (result.stdout + result.stderr).strip().splitlines()[-15:]
            shown = "\n  ".join(output)
            raise BrokerError(
                f"Formatting the Kafka storage in {data_dir} failed (exit {result.returncode}):\n"
                f"  {shown}\nIf the data dir belongs to another cluster, delete it or choose "
                f"another --data-dir; if the jars are damaged, delete {libs.parent} and retry."
            )

    def _launch(self, java: str, libs: Path, data_dir: Path) -> None:
        command = self._java_command(java, libs, data_dir, data_dir / "server.log") + [
            "kafka.Kafka",
            str(data_dir / "server.properties"),
        ]
        if self._die_with_parent:
            command = with_parent_watchdog(command)
        with (data_dir / "console.log").open("ab") as console:
            self._process = subprocess.Popen(
                command,
                cwd=data_dir,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                # Own session: a Ctrl-C meant for the launcher must not hit the broker first.
                start_new_session=True,
            )
        (data_dir / "broker.pid").write_text(str(self._process.pid))
        if self._die_with_parent:
            atexit.register(self.stop)

    def _wait_until_ready(self, bootstrap: str, deadline: float | None = None) -> None:
        assert self._process is not None and self._data_dir is not None
        port = int(bootstrap.rsplit(":", 1)[1])
        if deadline is None:
            deadline = time.monotonic() + self._startup_timeout
        while True:
            code = self._process.poll()
            if code is not None:
                raise BrokerError(
                    f"The local Kafka broker exited with code {code} while starting."
                    + self._log_hint()
                )
            if port_accepts(port) and node_serves(bootstrap, self.node_id, timeout=2.0):
                return
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"The local Kafka broker did not answer at {bootstrap} within "
                    f"{self._startup_timeout:.0f} s." + self._log_hint()
                )
            time.sleep(0.2)

    def _log_hint(self) -> str:
        assert self._data_dir is not None
        parts = []
        for path in (self._data_dir / "server.log", self._data_dir / "console.log"):
            lines = tail_lines(path, 20)
            if lines:
                parts.append(f"\nLast lines of {path}:\n  " + "\n  ".join(lines))
        if not parts:
            parts.append(f"\nNothing was logged; see {self._data_dir / 'server.log'}.")
        parts.append(
            "\nFix what the log names (port in use, out of memory, damaged jars: delete "
            f"{libs_dir(self.version).parent}), or set SNAPLINE_BOOTSTRAP_SERVERS to use an "
            "existing cluster."
        )
        return "".join(parts)

    def _kill_after_failed_start(self) -> None:
        # Keep the data dir: its server.log is what explains the failure.
        process, self._process = self._process, None
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        if self._data_dir is not None:
            with contextlib.suppress(OSError):
                (self._data_dir / "broker.pid").unlink()


# --------------------------------------------------------------------------- state file


def read_state() -> BrokerState | None:
    """The recorded broker, or None if none is recorded (a stale record is removed)."""
    path = state_file()
    try:
        state = BrokerState.from_json(path.read_text("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("Ignoring unreadable broker state file %s: %s", path, exc)
        path.unlink(missing_ok=True)
        return None
    if not is_broker_process(state.pid, state.data_dir):
        path.unlink(missing_ok=True)
        return None
    return state


def write_state(state: BrokerState) -> Path:
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state.to_json(), "utf-8")
    tmp.replace(path)
    return path


def clear_state(pid: int | None = None) -> None:
    """Remove the state file (only if it records ``pid``, when given)."""
    path = state_file()
    if pid is not None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if BrokerState.from_json(path.read_text("utf-8")).pid != pid:
                return
    path.unlink(missing_ok=True)


def stop_recorded_broker(grace: float = 20.0) -> BrokerState | None:
    """Stop the broker recorded in the state file; returns it, or None if none was running."""
    state = read_state()
    if state is None:
        return None
    pids = [state.pid] + [pid for pid, data_dir in state.other_nodes]
    alive = [
        p for p, d in [(state.pid, state.data_dir), *state.other_nodes] if is_broker_process(p, d)
    ]
    for pid in alive:  # all at once: a cluster's last node must not wait for a gone quorum
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid in alive:
        terminate_pid(pid, grace)
    survivors = [pid for pid in pids if _pid_alive(pid) and pid in alive]
    if survivors:
        raise BrokerError(
            f"Kafka broker pids {survivors} survived SIGKILL; check `ps -p {survivors[0]}`."
        )
    clear_state(state.pid)
    if state.temporary:
        # a cluster's nodes live in node-<i>/ under one temporary dir
        root = Path(state.data_dir).parent if state.other_nodes else Path(state.data_dir)
        shutil.rmtree(root, ignore_errors=True)
    return state


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
