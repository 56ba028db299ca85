"""The supervisor's restart policy (``decide``) and its handling of real child processes that
exit with each kind of code: a configuration error stops the job at once, crashes are
restarted with capped exponential backoff that a healthy run resets, EX_TEMPFAIL is never
given up on."""

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

from examples.workers import process_gone
from snapline.pipeline.supervisor import (
    EX_CONFIG,
    EX_TEMPFAIL,
    MESSAGE_FILE_ENV,
    RestartPolicy,
    Supervisor,
    decide,
)

POLICY = RestartPolicy(initial_backoff=1.0, max_backoff=30.0, healthy_after=30.0, max_failures=5)


def test_configuration_error_stops_everything_with_its_code() -> None:
    d = decide(EX_CONFIG, ran_for=0.5, failures_before=0, policy=POLICY, stopping=False)
    assert (d.action, d.exit_code) == ("stop_all", EX_CONFIG)
    # also after a long healthy run: restarting cannot fix configuration
    d = decide(EX_CONFIG, ran_for=3600, failures_before=0, policy=POLICY, stopping=False)
    assert d.action == "stop_all"


def test_clean_exit_is_not_restarted() -> None:
    assert decide(0, 100.0, 2, POLICY, stopping=False).action == "done"


def test_while_stopping_nothing_is_restarted() -> None:
    for code in (0, 1, -9, EX_TEMPFAIL, EX_CONFIG):
        d = decide(code, 1.0, 0, POLICY, stopping=True)
        assert d.action == "done" and d.exit_code == code


def test_crashes_back_off_exponentially_up_to_the_cap() -> None:
    failures = 0
    delays = []
    policy = RestartPolicy(max_failures=100)
    for _ in range(8):
        d = decide(1, ran_for=2.0, failures_before=failures, policy=policy, stopping=False)
        assert d.action == "restart"
        failures = d.failures
        delays.append(d.delay)
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]


def test_a_healthy_run_resets_the_backoff() -> None:
    d = decide(-9, ran_for=29.0, failures_before=4, policy=POLICY, stopping=False)
    assert (d.failures, d.delay) == (5, 16)
    d = decide(-9, ran_for=31.0, failures_before=4, policy=POLICY, stopping=False)
    assert (d.action, d.failures, d.delay) == ("restart", 1, 1)


def test_repeated_crashes_without_a_healthy_run_give_up() -> None:
    d = decide(1, ran_for=1.0, failures_before=5, policy=POLICY, stopping=False)
    assert (d.action, d.exit_code) == ("stop_all", 1)
    assert "giving up" in d.reason
    # killed by a signal: exit code 1, not a negative number
    assert decide(-9, 1.0, 5, POLICY, stopping=False).exit_code == 1


def test_tempfail_is_restarted_without_limit() -> None:
    d = decide(EX_TEMPFAIL, ran_for=0.1, failures_before=500, policy=POLICY, stopping=False)
    assert (d.action, d.delay) == ("restart", 30)


# ------------------------------------------------------------------ real child processes


class ScriptedSupervisor(Supervisor):
    """Runs a small Python script per worker instead of ``snapline run``."""

    def __init__(self, scripts: dict[str, str], policy: RestartPolicy) -> None:
        super().__init__("unused:spec", list(scripts), [], policy)
        self.scripts = scripts
        self.starts: dict[str, list[float]] = {w: [] for w in scripts}

    def _command(self, worker_id: str) -> list[str]:
        self.starts[worker_id].append(time.monotonic())
        return [sys.executable, "-c", self.scripts[worker_id]]


@pytest.fixture(autouse=True)
def _restore_signal_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


CONFIG_ERROR = f"""
import os, sys
open(os.environ[{MESSAGE_FILE_ENV!r}], "w").write("topics ['nope'] do not exist; create them")
sys.exit({EX_CONFIG})
"""
# Runs until SIGTERM, then exits 0 like a worker after its final checkpoint.
LONG_RUNNING = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
time.sleep(60)
sys.exit(3)
"""


def test_configuration_error_of_one_worker_stops_all_at_once(tmp_path: Path) -> None:
    sup = ScriptedSupervisor({"w0": CONFIG_ERROR, "w1": LONG_RUNNING}, POLICY)
    started = time.monotonic()
    code = sup.run()
    assert code == EX_CONFIG
    assert time.monotonic() - started < 10  # w1 was stopped, not waited for (60 s)
    assert sup.failure_message == "topics ['nope'] do not exist; create them"
    assert {w: len(s) for w, s in sup.starts.items()} == {"w0": 1, "w1": 1}


def test_crashing_worker_is_restarted_with_backoff_then_given_up(tmp_path: Path) -> None:
    policy = RestartPolicy(initial_backoff=0.2, max_backoff=0.8, healthy_after=30, max_failures=3)
    sup = ScriptedSupervisor({"w0": "import sys; sys.exit(1)", "w1": LONG_RUNNING}, policy)
    code = sup.run()
    assert code == 1
    assert sup.failure_message is None
    starts = sup.starts["w0"]
    assert len(starts) == 4  # the first start and three restarts, then it gives up
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # backoff 0.2, 0.4, 0.8 s (plus process run time and the 0.2 s poll)
    for gap, delay in zip(gaps, (0.2, 0.4, 0.8), strict=True):
        assert delay <= gap < delay + 5.0, gaps  # the upper bound: no runaway backoff
    assert len(sup.starts["w1"]) == 1


def test_a_child_gets_sigterm_when_its_supervisor_is_killed(tmp_path: Path) -> None:
    """A real parent starts a child the supervisor's way, then dies by SIGKILL: the child
    is told to stop (SIGTERM) instead of living on as an orphan."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import os, subprocess, sys, time
                from snapline.pipeline.supervisor import _stop_with_parent
                child = subprocess.Popen(
                    [sys.executable, "-c",
                     "import signal, sys, time\\n"
                     "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\\n"
                     "print('ready', flush=True)\\n"
                     "time.sleep(60)\\n"],
                    preexec_fn=_stop_with_parent(os.getpid()), stdout=subprocess.PIPE,
                )
                child.stdout.readline()
                print(child.pid, flush=True)
                time.sleep(60)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not process_gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(child), "the child outlived its killed supervisor"
    finally:
        parent.kill()
        if child and not process_gone(child):
            os.kill(child, signal.SIGKILL)
