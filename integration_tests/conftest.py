"""Fixtures of the integration tests: a real Kafka broker for the session, and helpers.

The broker is, in order: the cluster named by ``SNAPLINE_BOOTSTRAP_SERVERS``; a
testcontainers Kafka when ``SNAPLINE_KAFKA=docker`` and a Docker engine answers; else
Snapline's own local broker launcher. If none can be had the tests fail, never skip.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from examples.workers import DIED_OF_SIGNAL

if TYPE_CHECKING:
    from snapline.connectors.local.postgres import LocalPostgres

_HERE = Path(__file__).resolve().parent
_KAFKA_KEY = pytest.StashKey["KafkaInfo"]()


@dataclass(frozen=True)
class KafkaInfo:
    """Which broker the session used, for the report."""

    bootstrap_servers: str
    description: str


# --------------------------------------------------------------------------- hooks


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test here is ``integration``. Tests marked ``long`` (the long versions of chaos
    tests whose short versions run by default) run only when ``-m`` names them, e.g.
    ``bash scripts/test -m long``."""
    long_wanted = "long" in (config.option.markexpr or "")
    kept, deselected = [], []
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("long") is not None and not long_wanted:
            deselected.append(item)
        else:
            kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_report_header(config: pytest.Config) -> str:
    if os.environ.get("SNAPLINE_BOOTSTRAP_SERVERS"):
        return f"kafka: SNAPLINE_BOOTSTRAP_SERVERS={os.environ['SNAPLINE_BOOTSTRAP_SERVERS']}"
    from snapline.connectors.local.broker import kafka_version

    wanted = "testcontainers if a Docker engine answers, else " if _docker_requested() else ""
    return f"kafka: {wanted}local broker {kafka_version()} (launched on first use)"


_WORKER_LINES_KEY = pytest.StashKey[list[str]]()
_KEPT_LOG_KEY = pytest.StashKey[str]()


def _kafka_lines(config: pytest.Config) -> list[str]:
    """The summary's lines about the broker this process used."""
    lines = []
    info = config.stash.get(_KAFKA_KEY, None)
    if info is not None:
        lines.append(f"kafka: tests ran against {info.description}")
    kept = config.stash.get(_KEPT_LOG_KEY, None)
    if kept is not None:
        lines.append(f"kafka: some tests failed; the broker's log is kept in {kept}")
    return lines


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its summary lines to the controller, which prints them
    (a worker's own output is not shown)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["snapline_kafka"] = _kafka_lines(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    lines = getattr(node, "workeroutput", {}).get("snapline_kafka") or []
    node.config.stash.setdefault(_WORKER_LINES_KEY, []).extend(
        f"{line} ({node.gateway.id})" for line in lines
    )


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    for line in _kafka_lines(config) + sorted(config.stash.get(_WORKER_LINES_KEY, [])):
        terminalreporter.write_line(line)


# --------------------------------------------------------------------------- the broker


def _docker_requested() -> bool:
    return os.environ.get("SNAPLINE_KAFKA", "").lower() == "docker"


def _docker_answers() -> bool:
    try:
        from testcontainers.core.docker_client import DockerClient

        DockerClient().client.ping()
    except Exception:  # no engine, no socket, no permission: all mean "use the launcher"
        return False
    return True


@contextmanager
def _docker_kafka() -> Iterator[KafkaInfo]:
    from testcontainers.community.kafka import KafkaContainer

    container = KafkaContainer().with_kraft()
    # Single node: the transaction log must fit on one replica.
    container.with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
    container.with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
    with container:
        bootstrap = container.get_bootstrap_server()
        yield KafkaInfo(bootstrap, f"testcontainers {container.image} at {bootstrap}")


@contextmanager
def _launched_kafka(request: pytest.FixtureRequest) -> Iterator[KafkaInfo]:
    from snapline.connectors.local.broker import (
        LocalKafkaBroker,
        ensure_kafka_jars,
        jars_are_complete,
    )
    from snapline.connectors.local.broker import libs_dir as kafka_libs

    config = request.config
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def say(message: str) -> None:
        if reporter is None or capture is None:
            return
        with capture.global_and_fixture_disabled():
            reporter.ensure_newline()
            reporter.write_line(message)

    broker = LocalKafkaBroker()
    if not jars_are_complete(kafka_libs(broker.version)):
        say(f"kafka: downloading Kafka {broker.version} jars with Maven (first run only)…")
        ensure_kafka_jars(broker.version)
    with broker:
        description = f"launched local broker {broker.version} at {broker.bootstrap_servers}"
        say(f"kafka: {description} (log {broker.log_path})")
        yield KafkaInfo(broker.bootstrap_servers, description)
        if request.session.testsfailed and getattr(config, "cache", None) is not None:
            # The temporary data dir goes away with the broker; its log may explain a failure.
            worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1: one broker each
            kept = config.cache.mkdir("snapline") / (
                f"kafka-server-{worker}.log" if worker else "kafka-server.log"
            )
            shutil.copyfile(broker.log_path, kept)
            config.stash[_KEPT_LOG_KEY] = str(kept)  # the summary says where


def _kafka_for_session(request: pytest.FixtureRequest) -> AbstractContextManager[KafkaInfo]:
    from_env = os.environ.get("SNAPLINE_BOOTSTRAP_SERVERS")
    if from_env:

        @contextmanager
        def existing() -> Iterator[KafkaInfo]:
            yield KafkaInfo(from_env, f"SNAPLINE_BOOTSTRAP_SERVERS={from_env}")

        return existing()
    if _docker_requested() and _docker_answers():
        return _docker_kafka()
    return _launched_kafka(request)


@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest) -> Iterator[str]:
    """Bootstrap servers of a real Kafka broker shared by the whole session."""
    from snapline.pipeline.errors import BrokerError

    try:
        with _kafka_for_session(request) as info:
            request.config.stash[_KAFKA_KEY] = info
            yield info.bootstrap_servers
    except BrokerError as exc:
        pytest.fail(f"No Kafka broker for the integration tests:\n{exc}", pytrace=False)


@pytest.fixture(scope="session")
def admin(kafka_bootstrap: str) -> AdminClient:
    """An AdminClient on the session's broker."""
    return AdminClient({"bootstrap.servers": kafka_bootstrap})


#: What CPython's faulthandler writes first when a process dies of a fatal signal (SIGSEGV,
#: SIGABRT, SIGBUS, ...): workers enable it with every thread's stack. WorkerProcess writes
#: the second when it finds its process dead of a signal it did not send (faulthandler does
#: not always get to write its report).
FATAL_SIGNAL_MARKS = (b"Fatal Python error: ", DIED_OF_SIGNAL.encode())


def fatal_signal_reports(directory: Path) -> list[str]:
    """``<log>: <the line>`` for each process log under ``directory`` that a fatal signal
    ended."""
    found = []
    for log in sorted(directory.rglob("*.log")):
        try:
            data = log.read_bytes()
        except OSError:
            continue
        for mark in FATAL_SIGNAL_MARKS:
            at = data.find(mark)
            if at >= 0:
                end = data.find(b"\n", at)
                line = data[at : end if end >= 0 else None].decode(errors="replace")
                found.append(f"{log.relative_to(directory)}: {line}")
    return found


@pytest.fixture(autouse=True)
def _no_process_died_of_a_fatal_signal(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test fails if a process it ran died of a fatal signal, even when the test's own
    property held (its kill loop restarted the worker, recovery made up for it): a worker
    that segfaults is a defect of its own (confluent-kafka's ``delete_records`` corrupted the
    heap, and the join kill test passed twice in three runs with a SIGSEGV in its logs). The
    logs looked at are those under the test's ``tmp_path``, where its workers write."""
    yield
    directory = request.node.funcargs.get("tmp_path")
    if isinstance(directory, Path) and directory.exists():
        reports = fatal_signal_reports(directory)
        if reports:
            pytest.fail("a process died of a fatal signal:\n" + "\n".join(reports))


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A topic/group/transactional-id prefix unique to this test: ``t-<test>-<uuid8>``."""
    test = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:40]
    return f"t-{test}-{uuid.uuid4().hex[:8]}"


def create_topic(
    admin: AdminClient,
    name: str,
    partitions: int = 1,
    config: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> str:
    """Create ``name`` and wait until every partition has a leader; returns ``name``."""
    futures = admin.create_topics(
        [NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})],
        operation_timeout=timeout,
    )
    futures[name].result(timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        topic = admin.list_topics(name, timeout=timeout).topics.get(name)
        if (
            topic is not None
            and topic.error is None
            and len(topic.partitions) == partitions
            and all(p.leader >= 0 for p in topic.partitions.values())
        ):
            return name
        if time.monotonic() > deadline:
            raise TimeoutError(f"topic {name} has no leader for every partition after {timeout} s")
        time.sleep(0.1)


# --- sinks fixtures ---------------------------------------------------------------------------
# Owned by the Parquet/PostgreSQL sinks work: a Spark session and a PostgreSQL database for the
# session. Both fail (never skip) when the component is missing.


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A ``local[2]`` SparkSession shared by the session (PySpark from PyPI, Java 17+)."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.fail(
            "Spark tests need Java 17+: apt-get install openjdk-17-jre-headless (or set JAVA_HOME)",
            pytrace=False,
        )
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        pytest.fail(
            f"Spark tests need PySpark: pip install 'snapline[spark]' ({exc})", pytrace=False
        )
    session = (
        SparkSession.builder.master("local[2]")
        .appName("snapline-integration-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """DSN of a PostgreSQL database for the session.

    ``SNAPLINE_POSTGRES_DSN`` names an existing database; otherwise a throwaway server from
    Debian's packages is started (``snapline.connectors.local.postgres``; install it with
    ``bash scripts/install-postgres.sh``).
    """
    from_env = os.environ.get("SNAPLINE_POSTGRES_DSN")
    if from_env:
        yield from_env
        return
    with _started_postgres("the integration tests") as server:
        yield server.dsn


@contextmanager
def _started_postgres(what: str) -> Iterator[LocalPostgres]:
    """A throwaway PostgreSQL server, stopped (and its directory deleted) at the end; a
    server that cannot start fails the test, naming ``what`` needed it."""
    from snapline.connectors.local.postgres import LocalPostgres

    server = LocalPostgres()
    try:
        server.start()
    except Exception as exc:
        server.stop()
        pytest.fail(f"No PostgreSQL for {what}:\n{exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_postgres() -> Iterator[LocalPostgres]:
    """A PostgreSQL server of the test's own, which it may stop and start (the session's
    must stay up)."""
    with _started_postgres("the test") as server:
        yield server


# --- end of sinks fixtures --------------------------------------------------------------------


@pytest.fixture
def jobs() -> Iterator[list[Any]]:
    """Warehouse jobs a test made (integration_tests/warehouse_job.py); their workers are
    SIGKILLed at the end, whatever the test left running."""
    made: list[Any] = []
    yield made
    for job in made:
        for worker in job.workers:
            worker.kill()
