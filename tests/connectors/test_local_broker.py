"""Pure logic of the local broker launcher: config rendering, the jar cache, prerequisites."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from snapline.connectors.local import broker as local_broker
from snapline.connectors.local.broker import (
    DEFAULT_KAFKA_VERSION,
    MARKER_NAME,
    BrokerState,
    LocalKafkaBroker,
    cache_dir,
    condense_maven_line,
    ensure_kafka_jars,
    find_java,
    find_maven,
    free_ports,
    jars_are_complete,
    kafka_version,
    libs_dir,
    new_cluster_id,
    parse_java_version,
    read_state,
    render_pom,
    render_server_properties,
    transaction_marker_defect,
    write_completion_marker,
    write_state,
)
from snapline.pipeline.errors import BrokerError


def parse_properties(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if line and line[0] != "#")
    return {key: value for key, value in pairs}


def executable(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nPATH=/usr/bin:/bin\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SNAPLINE_CACHE_DIR", str(root))
    monkeypatch.delenv("SNAPLINE_KAFKA_VERSION", raising=False)
    return root


@pytest.fixture
def only_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty PATH directory (fake tools go there) and no JAVA_HOME."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    return bin_dir


# --------------------------------------------------------------------------- config


def test_server_properties_describe_a_single_loopback_kraft_node(tmp_path: Path) -> None:
    props = parse_properties(
        render_server_properties(port=9092, controller_port=9093, log_dirs=tmp_path / "logs")
    )

    assert props["process.roles"] == "broker,controller"
    assert props["node.id"] == "1"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093"
    assert props["advertised.listeners"] == props["listeners"]
    assert props["controller.quorum.bootstrap.servers"] == "127.0.0.1:9093"
    assert props["controller.listener.names"] == "CONTROLLER"
    assert props["log.dirs"] == str(tmp_path / "logs")
    assert props["transaction.state.log.replication.factor"] == "1"
    assert props["transaction.state.log.min.isr"] == "1"
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    assert props["auto.create.topics.enable"] == "false"


def test_server_properties_of_a_cluster_node_replicate_internal_topics(tmp_path: Path) -> None:
    voters = "1@127.0.0.1:9093,2@127.0.0.1:9095,3@127.0.0.1:9097"
    props = parse_properties(
        render_server_properties(
            port=9094, controller_port=9095, log_dirs=tmp_path, node_id=2, quorum_voters=voters
        )
    )
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == voters
    assert "controller.quorum.bootstrap.servers" not in props  # a static quorum
    for key in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "default.replication.factor",
    ):
        assert props[key] == "3", key
    assert props["transaction.state.log.min.isr"] == "2"
    assert props["min.insync.replicas"] == "2"
    assert props["unclean.leader.election.enable"] == "false"


def test_server_properties_overrides_win(tmp_path: Path) -> None:
    text = render_server_properties(
        port=1,
        controller_port=2,
        log_dirs=tmp_path,
        overrides={"auto.create.topics.enable": "true", "log.retention.ms": "1000"},
    )
    props = parse_properties(text)
    assert props["auto.create.topics.enable"] == "true"
    assert props["log.retention.ms"] == "1000"
    assert text.count("auto.create.topics.enable") == 1


def test_cluster_id_is_unpadded_urlsafe_base64_of_16_bytes() -> None:
    cluster_id = new_cluster_id()
    assert len(cluster_id) == 22 and "=" not in cluster_id
    assert len(base64.urlsafe_b64decode(cluster_id + "==")) == 16


def test_cluster_id_never_starts_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    # 0xf8 encodes to "-" first: a command line would read that id as an option.
    ids = iter([uuid.UUID(bytes=b"\xf8" + bytes(15)), uuid.UUID(bytes=b"\x01" * 16)])
    monkeypatch.setattr(local_broker.uuid, "uuid4", lambda: next(ids))
    assert new_cluster_id() == base64.urlsafe_b64encode(b"\x01" * 16).decode().rstrip("=")


def test_pom_pins_the_requested_kafka_release() -> None:
    pom = render_pom("4.3.1")
    assert "<artifactId>kafka_2.13</artifactId>\n      <version>4.3.1</version>" in pom
    assert "@KAFKA_VERSION@" not in pom
    assert "log4j-slf4j-impl" in pom


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(2)
    assert len(set(ports)) == 2
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


# --------------------------------------------------------------------------- versions and paths


def test_kafka_version_default_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPLINE_KAFKA_VERSION", raising=False)
    assert kafka_version() == DEFAULT_KAFKA_VERSION == "4.2.1"
    monkeypatch.setenv("SNAPLINE_KAFKA_VERSION", "4.2.0")
    assert kafka_version() == "4.2.0"
    assert kafka_version("3.9.1") == "3.9.1"


@pytest.mark.parametrize(
    ("version", "affected"),
    [("4.2.1", False), ("4.2.0", False), ("3.9.1", False), ("4.3.0", True), ("4.3.1", True)],
)
def test_versions_with_the_transaction_marker_defect_are_named(
    version: str, affected: bool
) -> None:
    found = transaction_marker_defect(version)
    assert (found is not None) == affected
    if found:
        assert "KAFKA-20734" in found and version in found
        assert f"Use Kafka {DEFAULT_KAFKA_VERSION}" in found


def test_the_default_version_is_free_of_the_transaction_marker_defect() -> None:
    assert transaction_marker_defect(DEFAULT_KAFKA_VERSION) is None


@pytest.mark.parametrize("bad", ["latest", "4.3", "4.3.1</version>", "../4.3.1"])
def test_kafka_version_rejects_non_release_strings(bad: str) -> None:
    with pytest.raises(BrokerError, match="SNAPLINE_KAFKA_VERSION"):
        kafka_version(bad)


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SNAPLINE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "snapline"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "snapline"
    monkeypatch.setenv("SNAPLINE_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    assert libs_dir("4.3.1") == tmp_path / "mine" / "kafka" / "4.3.1" / "libs"


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime Environment', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_292"', 8),
        ('openjdk version "11.0.2-ea" 2019-01-15', 11),
        ('Picked up JAVA_TOOL_OPTIONS: -Xss1m\nopenjdk version "25" 2025-09-16', 25),
        ("something else entirely", None),
    ],
)
def test_parse_java_version(output: str, major: int | None) -> None:
    assert parse_java_version(output) == major


# --------------------------------------------------------------------------- prerequisites


def test_missing_java_says_how_to_install_it(only_path: Path) -> None:
    with pytest.raises(BrokerError, match="apt-get install openjdk-17-jre-headless"):
        find_java()


def test_old_java_is_refused_with_its_version(only_path: Path) -> None:
    executable(only_path / "java", """echo 'java version "1.8.0_292"' >&2\n""")
    with pytest.raises(BrokerError, match=r"version 8.*openjdk-17-jre-headless"):
        find_java()


def test_java_home_wins_over_path(only_path: Path, tmp_path: Path, monkeypatch) -> None:
    executable(only_path / "java", """echo 'java version "1.8.0_292"' >&2\n""")
    good = executable(
        tmp_path / "jdk" / "bin" / "java", """echo 'openjdk version "17.0.1"' >&2\n"""
    )
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))
    assert find_java() == str(good)


def test_missing_maven_says_how_to_install_it(only_path: Path) -> None:
    with pytest.raises(BrokerError, match="apt-get install maven"):
        find_maven()


# --------------------------------------------------------------------------- jar cache


def test_marker_logic(tmp_path: Path) -> None:
    libs = tmp_path / "libs"
    assert not jars_are_complete(libs)
    libs.mkdir()
    (libs / "a.jar").write_bytes(b"x")
    (libs / "b.jar").write_bytes(b"x")
    assert not jars_are_complete(libs), "jars without a marker are a half download"

    write_completion_marker(libs, "4.3.1")
    assert jars_are_complete(libs)
    assert json.loads((libs / MARKER_NAME).read_text())["jars"] == ["a.jar", "b.jar"]

    (libs / "b.jar").unlink()
    assert not jars_are_complete(libs), "a jar deleted after the download"

    (libs / MARKER_NAME).write_text("{not json")
    assert not jars_are_complete(libs)


def fake_maven(bin_dir: Path, *, fail: bool = False) -> Path:
    """An ``mvn`` that 'downloads' two jars into -DoutputDirectory (or fails like Maven)."""
    calls = bin_dir / "mvn-calls"
    if fail:
        body = (
            f"echo call >> {calls}\n"
            "echo '[INFO] Scanning for projects...'\n"
            "echo '[ERROR] Failed to execute goal on project kafka-broker-libs: "
            "Could not resolve dependencies: kafka-tools-api:jar:4.4.0 was not found'\n"
            "echo '[ERROR] '\n"
            "exit 1\n"
        )
    else:
        body = (
            f"echo call >> {calls}\n"
            'for arg in "$@"; do case "$arg" in -DoutputDirectory=*) out="${arg#*=}";; esac; done\n'
            'mkdir -p "$out"\n'
            "echo '[INFO] Downloading from central: https://repo/x/kafka_2.13-4.3.1.jar'\n"
            "echo 'Downloaded from central: https://r/kafka_2.13-4.3.1.jar (6.9 MB at 3 MB/s)'\n"
            'echo jar > "$out/kafka_2.13-4.3.1.jar"\n'
            'echo jar > "$out/kafka-clients-4.3.1.jar"\n'
        )
    executable(bin_dir / "mvn", body)
    return calls


@pytest.fixture
def java_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_broker, "find_java", lambda: "java")


def test_download_writes_marker_and_is_reused(cache: Path, only_path: Path, java_ok: None) -> None:
    calls = fake_maven(only_path)
    messages: list[str] = []

    libs = ensure_kafka_jars("4.3.1", messages.append)

    assert libs == cache / "kafka" / "4.3.1" / "libs"
    assert jars_are_complete(libs)
    assert "downloaded kafka_2.13-4.3.1.jar (6.9 MB)" in messages
    assert ensure_kafka_jars("4.3.1") == libs
    assert calls.read_text().count("call") == 1, "a complete cache must not run Maven again"


def test_half_download_is_redone(cache: Path, only_path: Path, java_ok: None) -> None:
    fake_maven(only_path)
    libs = libs_dir("4.3.1")
    libs.mkdir(parents=True)
    (libs / "kafka_2.13-4.3.1.jar").write_bytes(b"truncated")
    (libs / "stale-leftover.jar").write_bytes(b"x")

    ensure_kafka_jars("4.3.1")

    assert jars_are_complete(libs)
    assert not (libs / "stale-leftover.jar").exists()
    assert (libs / "kafka_2.13-4.3.1.jar").read_text() == "jar\n"


def test_failed_download_shows_mavens_errors(cache: Path, only_path: Path, java_ok: None) -> None:
    fake_maven(only_path, fail=True)
    with pytest.raises(BrokerError) as raised:
        ensure_kafka_jars("4.4.0")
    message = str(raised.value)
    assert "kafka-tools-api:jar:4.4.0 was not found" in message
    assert f"SNAPLINE_KAFKA_VERSION={DEFAULT_KAFKA_VERSION}" in message
    assert not jars_are_complete(libs_dir("4.4.0"))


def test_download_without_maven_fails_clearly(cache: Path, only_path: Path, java_ok: None) -> None:
    with pytest.raises(BrokerError, match="apt-get install maven"):
        ensure_kafka_jars("4.3.1")


def test_cached_jars_need_no_maven(cache: Path, only_path: Path) -> None:
    libs = libs_dir("4.3.1")
    libs.mkdir(parents=True)
    (libs / "kafka_2.13-4.3.1.jar").write_bytes(b"x")
    write_completion_marker(libs, "4.3.1")
    assert ensure_kafka_jars("4.3.1") == libs


def test_starting_without_java_fails_before_anything_else(cache: Path, only_path: Path) -> None:
    with pytest.raises(BrokerError, match="openjdk-17-jre-headless"):
        LocalKafkaBroker("4.3.1").start()
    assert not (cache / "kafka").exists()


def test_condense_maven_line() -> None:
    assert (
        condense_maven_line("Downloading from central: https://r/m/kafka_2.13-4.3.1.pom")
        == "downloading kafka_2.13-4.3.1.pom"
    )
    assert (
        condense_maven_line(
            "Downloaded from central: https://r/m/zstd-jni-1.5.6-10.jar (7.0 MB at 2.1 MB/s)"
        )
        == "downloaded zstd-jni-1.5.6-10.jar (7.0 MB)"
    )
    assert (
        condense_maven_line(
            "\x1b[0m[INFO] Downloaded from central: https://r/a-1.pom (3.9 kB at 1 MB/s)"
        )
        == "downloaded a-1.pom (3.9 kB)"
    )
    assert condense_maven_line("[INFO] Copying kafka_2.13-4.3.1.jar to /x") is None
    assert condense_maven_line("[ERROR] boom") == "[ERROR] boom"


# --------------------------------------------------------------------------- state file


def test_broker_state_round_trips_through_json() -> None:
    state = BrokerState(
        pid=42,
        bootstrap_servers="127.0.0.1:9092",
        log_path="/tmp/d/server.log",
        data_dir="/tmp/d",
        temporary=True,
        version="4.3.1",
        started_at="2026-01-01T00:00:00+00:00",
        detached=True,
    )
    assert BrokerState.from_json(state.to_json()) == state


def test_state_of_a_dead_broker_is_discarded(cache: Path) -> None:
    state = BrokerState(
        pid=2**22 + 12345,  # above the kernel's pid_max default: never alive
        bootstrap_servers="127.0.0.1:9092",
        log_path="/nowhere/server.log",
        data_dir="/nowhere",
        temporary=True,
        version="4.3.1",
        started_at="2026-01-01T00:00:00+00:00",
        detached=True,
    )
    path = write_state(state)
    assert path.exists()
    assert read_state() is None
    assert not path.exists()


def test_state_of_an_unrelated_live_process_is_discarded(cache: Path) -> None:
    state = BrokerState(
        pid=os.getpid(),  # alive, but not a kafka.Kafka java process
        bootstrap_servers="127.0.0.1:9092",
        log_path="/nowhere/server.log",
        data_dir="/nowhere",
        temporary=False,
        version="4.3.1",
        started_at="2026-01-01T00:00:00+00:00",
        detached=True,
    )
    write_state(state)
    assert read_state() is None


# ------------------------------------------------------------- never outlive the parent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_watchdog_kills_the_child_when_its_parent_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    sleep = shutil.which("sleep")
    parent_code = (
        "import subprocess, time\n"
        "from snapline.connectors.local.broker import with_parent_watchdog\n"
        f"child = subprocess.Popen(with_parent_watchdog([{sleep!r}, '60']))\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], env={**os.environ, "PYTHONPATH": str(repo)}
    )
    try:
        deadline = time.monotonic() + 10
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the parent never started its child"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        time.sleep(0.3)  # let the wrapper exec the real command
        assert local_broker._pid_alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while local_broker._pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not local_broker._pid_alive(child), "the child outlived its SIGKILLed parent"
