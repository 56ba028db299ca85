"""The fault-injection hook's spec parsing: kill points, odds and the stop and leave actions."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from snapline.pipeline.runtime import faults
from snapline.pipeline.runtime.faults import KILL_POINTS, FaultInjector


def test_empty_spec_is_a_no_op() -> None:
    injector = FaultInjector("", log_path="")
    assert not injector.enabled
    for name in KILL_POINTS:
        injector.point(name)  # returns: no signal is sent


def test_unknown_point_and_action_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown kill point 'nowhere'"):
        FaultInjector("nowhere:1", log_path="")
    with pytest.raises(ValueError, match="unknown fault action 'pause'"):
        FaultInjector("sync_snapshot:1:pause", log_path="")
    with pytest.raises(ValueError, match="librdkafka thread: use kill or stop"):
        FaultInjector("before_repartition_delete:1:leave", log_path="")


def test_kill_and_stop_send_their_signal_and_stop_fires_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sent: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    log = tmp_path / "faults.log"
    injector = FaultInjector("after_offsets_sent:1:stop,after_kafka_commit:1", log_path=str(log))
    injector.point("after_offsets_sent")
    injector.point("after_offsets_sent")  # a stop fires at most once per process
    injector.point("after_kafka_commit")
    injector.point("sync_snapshot")  # not in the spec
    assert sent == [signal.SIGSTOP, signal.SIGKILL]
    assert [line.split()[2] for line in log.read_text().splitlines()] == [
        "after_offsets_sent",
        "after_kafka_commit",
    ]


def test_zero_odds_never_fire(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    injector = FaultInjector("sync_snapshot:0", log_path="")
    for _ in range(100):
        injector.point("sync_snapshot")
    assert sent == []


def test_leave_and_stall_call_the_workers_hooks_once_and_send_no_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[int] = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append(sig))
    injector = FaultInjector("after_kafka_commit:1:leave,sync_snapshot:1:stall", log_path="")
    called: list[str] = []
    injector.hooks = {
        "leave": lambda: called.append("leave"),
        "stall": lambda: called.append("stall"),
    }
    for _ in range(2):
        injector.point("after_kafka_commit")
        injector.point("sync_snapshot")
    assert called == ["leave", "stall"] and sent == []
