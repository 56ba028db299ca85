"""The local directory lock against real processes: held while its process lives, freed by
the kernel when it dies (SIGKILL included), never kept alive by a forked child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.runtime.local_lock import LOCK_WAIT, lock_local_dir, lock_wait
from snapline.pipeline.runtime.worker import STOP_BOUND

#: The holder prints "locked" (and its child's pid) once it holds the lock, then sleeps.
HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from snapline.pipeline.runtime.local_lock import lock_local_dir
    lock_local_dir(Path(sys.argv[1]), "job", "w0", wait=0)
    child = os.fork() if sys.argv[2] == "fork" else 0
    if child == 0 and sys.argv[2] == "fork":
        time.sleep(60)
        os._exit(0)
    print("locked", child, flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait(10)


def _hold(root: Path, holders: list[subprocess.Popen[str]], fork: bool = False) -> int:
    """Start a process holding root's lock; returns its forked child's pid (0: none)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root), "fork" if fork else "-"],
        stdout=subprocess.PIPE,
        text=True,
    )
    holders.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # ends: the holder prints or dies (its pipe closes)
    assert line.startswith("locked"), f"holder exited with {proc.wait(10)}"
    return int(line.split()[1])


def test_a_second_process_is_refused_naming_the_holder(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    _hold(tmp_path, holders)
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as raised:
        lock_local_dir(tmp_path, "job", "w0", wait=0.5)
    assert time.monotonic() - started >= 0.5
    message = str(raised.value)
    assert f"pid {holders[0].pid}" in message and "--worker-id" in message
    # Another job's lock in the same worker directory is its own.
    os.close(lock_local_dir(tmp_path, "other-job", "w0", wait=0))


def test_the_lock_of_a_killed_process_is_free_at_once(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    _hold(tmp_path, holders)
    holders[0].send_signal(signal.SIGKILL)
    holders[0].wait(10)
    os.close(lock_local_dir(tmp_path, "job", "w0", wait=0))


def test_a_holder_that_exits_while_we_wait_hands_the_lock_over(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    _hold(tmp_path, holders)
    killer = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {holders[0].pid}"])
    try:
        os.close(lock_local_dir(tmp_path, "job", "w0", wait=20))
    finally:
        killer.wait(10)


def test_a_dead_workers_forked_child_does_not_keep_the_lock(
    tmp_path: Path, holders: list[subprocess.Popen[str]]
) -> None:
    child = _hold(tmp_path, holders, fork=True)
    try:
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait(10)
        os.kill(child, 0)  # the child still lives
        os.close(lock_local_dir(tmp_path, "job", "w0", wait=0))
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_local_dir_that_cannot_be_created_fails_with_the_fix(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigurationError, match="--local-dir"):
        lock_local_dir(blocker / "w0", "job", "w0", wait=0)


def test_the_wait_covers_a_stopping_workers_final_checkpoint() -> None:
    """A predecessor told to stop (SIGTERM, or its supervisor's death) may hold the lock for
    up to STOP_BOUND while it takes its final checkpoint: its successor must outwait that."""
    assert LOCK_WAIT >= STOP_BOUND


def test_the_wait_can_be_set_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPLINE_LOCAL_LOCK_WAIT", raising=False)
    assert lock_wait() == LOCK_WAIT
    monkeypatch.setenv("SNAPLINE_LOCAL_LOCK_WAIT", "3")
    assert lock_wait() == 3.0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("SNAPLINE_LOCAL_LOCK_WAIT", bad)
        with pytest.raises(ConfigurationError, match="SNAPLINE_LOCAL_LOCK_WAIT"):
            lock_wait()
