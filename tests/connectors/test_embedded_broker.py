"""The embedded broker of ``snapline run``: where its data lives, and the errors that stop a
run before a broker starts (no broker needed)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapline.connectors.local import embedded
from snapline.connectors.local.broker import BrokerState
from snapline.connectors.local.embedded import embedded_data_dir, start_embedded_broker
from snapline.pipeline.errors import BrokerError


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No state file of a real `snapline kafka start` may leak into these tests.
    monkeypatch.setenv("SNAPLINE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def listening_port() -> Iterator[int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_data_dir_is_beside_a_local_checkpoint_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert embedded_data_dir(".snapline/checkpoints") == tmp_path / ".snapline" / "kafka"
    assert embedded_data_dir(str(tmp_path / "jobs" / "chk")) == tmp_path / "jobs" / "kafka"
    assert embedded_data_dir(f"file://{tmp_path}/jobs/chk") == tmp_path / "jobs" / "kafka"


def test_data_dir_for_an_object_store_is_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert embedded_data_dir("s3://bucket/chk") == tmp_path / ".snapline" / "kafka"


def test_a_taken_remembered_port_fails_with_the_fix(tmp_path: Path, listening_port: int) -> None:
    data_dir = tmp_path / "kafka"
    data_dir.mkdir()
    (data_dir / "ports.json").write_text(
        json.dumps({"port": listening_port, "controller_port": listening_port + 1})
    )
    with pytest.raises(BrokerError) as caught:
        start_embedded_broker(str(tmp_path / "checkpoints"))
    message = str(caught.value)
    assert f"Port {listening_port}" in message
    assert str(data_dir / "ports.json") in message
    assert "--bootstrap-servers" in message and "ss -ltnp" in message


def test_a_broker_owned_by_another_run_is_not_started_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data_dir = tmp_path / "kafka"
    data_dir.mkdir()
    (data_dir / "broker.pid").write_text("4242")
    monkeypatch.setattr(embedded, "is_broker_process", lambda pid, d: pid == 4242)
    with pytest.raises(BrokerError, match="kafka start --detach --data-dir"):
        start_embedded_broker(str(tmp_path / "checkpoints"))


def test_a_broker_of_snapline_kafka_start_on_the_data_dir_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = BrokerState(
        pid=4242,
        bootstrap_servers="127.0.0.1:40123",
        log_path=str(tmp_path / "kafka" / "server.log"),
        data_dir=str(tmp_path / "kafka"),
        temporary=False,
        version="4.3.1",
        started_at="2026-01-01T00:00:00+00:00",
        detached=True,
    )
    monkeypatch.setattr(embedded, "read_state", lambda: state)
    found = start_embedded_broker(str(tmp_path / "checkpoints"))
    assert found.bootstrap_servers == "127.0.0.1:40123"
    assert found.broker is None  # not ours to stop
    assert "snapline kafka start" in found.description
