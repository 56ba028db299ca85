"""The supervisor's restart policy (``decide``) and its handling of real child processes that
exit with each kind of code: a configuration error stops the job at once, crashes are
restarted with capped exponential backoff that a healthy run (one that committed a checkpoint)
resets, EX_TEMPFAIL is never given up on; a stop signal reaches every child, also one being
started when it comes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.workers import process_gone
from snapline.pipeline import supervisor as supervisor_module
from snapline.pipeline.supervisor import (
    COMMITTED_FILE_ENV,
    EX_CONFIG,
    EX_SUPERSEDED,
    EX_TEMPFAIL,
    IDLE_HEALTHY_ENV,
    MESSAGE_FILE_ENV,
    RestartPolicy,
    Supervisor,
    decide,
    idle_healthy_after,
    report_committed,
    report_idle_healthy,
)

POLICY = RestartPolicy(initial_backoff=1.0, max_backoff=30.0, max_failures=5)


def test_configuration_error_stops_everything_with_its_code() -> None:
    d = decide(EX_CONFIG, healthy=False, failures_before=0, policy=POLICY, stopping=False)
    assert (d.action, d.exit_code) == ("stop_all", EX_CONFIG)
    # also after a healthy run: restarting cannot fix configuration
    d = decide(EX_CONFIG, healthy=True, failures_before=0, policy=POLICY, stopping=False)
    assert d.action == "stop_all"


def test_a_superseded_worker_is_not_restarted_and_stops_nobody_else() -> None:
    d = decide(EX_SUPERSEDED, healthy=True, failures_before=0, policy=POLICY, stopping=False)
    assert (d.action, d.exit_code) == ("done", EX_SUPERSEDED)


def test_clean_exit_is_not_restarted() -> None:
    assert decide(0, True, 2, POLICY, stopping=False).action == "done"


def test_while_stopping_nothing_is_restarted() -> None:
    for code in (0, 1, -9, EX_TEMPFAIL, EX_CONFIG):
        d = decide(code, False, 0, POLICY, stopping=True)
        assert d.action == "done" and d.exit_code == code


def test_crashes_back_off_exponentially_up_to_the_cap() -> None:
    failures = 0
    delays = []
    policy = RestartPolicy(max_failures=100)
    for _ in range(8):
        d = decide(1, healthy=False, failures_before=failures, policy=policy, stopping=False)
        assert d.action == "restart"
        failures = d.failures
        delays.append(d.delay)
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]


def test_a_healthy_run_resets_the_backoff() -> None:
    d = decide(-9, healthy=False, failures_before=4, policy=POLICY, stopping=False)
    assert (d.failures, d.delay) == (5, 16)
    d = decide(-9, healthy=True, failures_before=4, policy=POLICY, stopping=False)
    assert (d.action, d.failures, d.delay) == ("restart", 1, 1)


def test_repeated_crashes_without_a_healthy_run_give_up() -> None:
    d = decide(1, healthy=False, failures_before=5, policy=POLICY, stopping=False)
    assert (d.action, d.exit_code) == ("stop_all", 1)
    assert "giving up" in d.reason and "without committing a checkpoint" in d.reason
    # killed by a signal: exit code 1, not a negative number
    assert decide(-9, False, 5, POLICY, stopping=False).exit_code == 1
    # a crash after a committed checkpoint starts a new count, however many came before
    assert decide(1, True, 5, POLICY, stopping=False).action == "restart"


def test_tempfail_is_restarted_without_limit() -> None:
    d = decide(EX_TEMPFAIL, healthy=False, failures_before=500, policy=POLICY, stopping=False)
    assert (d.action, d.delay) == ("restart", 30)


def test_tempfail_backoff_resets_only_after_a_healthy_run() -> None:
    # a worker that exits 75 again and again without committing (storage that hangs, a
    # restore that ends in the same error) backs off; one that committed starts at 1 s
    d = decide(EX_TEMPFAIL, healthy=False, failures_before=4, policy=POLICY, stopping=False)
    assert (d.action, d.failures, d.delay) == ("restart", 5, 16)
    d = decide(EX_TEMPFAIL, healthy=True, failures_before=4, policy=POLICY, stopping=False)
    assert (d.action, d.failures, d.delay) == ("restart", 1, 1)


def test_report_committed_creates_the_file_at_the_first_checkpoint_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "w0.committed"
    monkeypatch.setenv(COMMITTED_FILE_ENV, str(path))
    report_committed(2)
    assert not path.exists()
    report_committed(1)
    assert path.exists()
    # not supervised: nothing to do
    monkeypatch.delenv(COMMITTED_FILE_ENV)
    report_committed(1)
    # its directory removed by a cleaner of /tmp during a long run: made again
    again = tmp_path / "cleaned" / "w0.committed"
    monkeypatch.setenv(COMMITTED_FILE_ENV, str(again))
    report_committed(1)
    assert again.exists()
    # nowhere to write it: logged, the worker goes on
    monkeypatch.setenv(COMMITTED_FILE_ENV, str(tmp_path / "gone" / "gone" / "w0.committed"))
    with caplog.at_level(logging.WARNING):
        report_committed(1)
    assert "first committed checkpoint" in caplog.text


# ------------------------------------------------------------------ real child processes


class ScriptedSupervisor(Supervisor):
    """Runs a small Python script per worker instead of ``snapline run``."""

    def __init__(self, scripts: dict[str, str], policy: RestartPolicy) -> None:
        super().__init__("unused:spec", list(scripts), [], policy)
        self.scripts = scripts
        self.starts: dict[str, list[float]] = {w: [] for w in scripts}
        #: The worker's failures in a row when it was started.
        self.failures_at_start: dict[str, list[int]] = {w: [] for w in scripts}

    def _command(self, worker_id: str) -> list[str]:
        self.starts[worker_id].append(time.monotonic())
        self.failures_at_start[worker_id].append(self.failures[worker_id])
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
# Commits a checkpoint (as report_committed does), then crashes.
COMMITS_THEN_CRASHES = f"""
import os, sys
open(os.environ[{COMMITTED_FILE_ENV!r}], "w").close()
sys.exit(1)
"""
# Commits a checkpoint, then its file is removed (a cleaner of /tmp) before it crashes.
COMMITS_THEN_CLEANED_THEN_CRASHES = f"""
import os, sys, time
open(os.environ[{COMMITTED_FILE_ENV!r}], "w").close()
time.sleep(1.0)  # five polls of the supervisor
os.unlink(os.environ[{COMMITTED_FILE_ENV!r}])
sys.exit(1)
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


SUPERSEDED = f"""
import os, sys
open(os.environ[{MESSAGE_FILE_ENV!r}], "w").write("worker 'w0' was replaced by pid 7 on host b")
sys.exit({EX_SUPERSEDED})
"""
# Runs 2 s, then exits 0 by itself (it was not stopped).
RUNS_TWO_SECONDS = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
time.sleep(2)
"""


def test_a_superseded_worker_leaves_the_others_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The host was not replaced as a whole (or two services share an id): the worker another
    process replaced stops, its message is logged, the others go on, and the supervisor ends
    with EX_SUPERSEDED once they are done."""
    sup = ScriptedSupervisor({"w0": SUPERSEDED, "w1": RUNS_TWO_SECONDS}, POLICY)
    with caplog.at_level(logging.ERROR):
        code = sup.run()
    assert code == EX_SUPERSEDED
    assert {w: len(s) for w, s in sup.starts.items()} == {"w0": 1, "w1": 1}
    assert "replaced by pid 7 on host b" in caplog.text
    assert "stopping all workers" not in caplog.text  # w1 ran to its end (else exit 3)


def test_crashing_worker_is_restarted_with_backoff_then_given_up(tmp_path: Path) -> None:
    policy = RestartPolicy(initial_backoff=0.2, max_backoff=0.8, max_failures=3)
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


class LongRuns(ScriptedSupervisor):
    """Every run of a worker looks ``seconds`` long (10 minutes) to the supervisor; stops after
    ``limit`` starts of a worker (a supervisor that never gave up would otherwise run forever)."""

    limit = 8
    seconds = 600.0

    def _start(self, worker_id: str) -> None:
        super()._start(worker_id)
        if worker_id in self.started_at:
            self.started_at[worker_id] -= self.seconds
        if len(self.starts[worker_id]) >= self.limit:
            self.stop()


def test_long_runs_without_a_committed_checkpoint_are_given_up() -> None:
    """A worker that fails the same way every time, after minutes (checkpoints that time out,
    a crash right after a long restore), is a crash loop: the wall-clock time it ran does not
    make it healthy."""
    policy = RestartPolicy(initial_backoff=0.05, max_backoff=0.1, max_failures=3)
    sup = LongRuns({"w0": "import sys; sys.exit(1)"}, policy)
    assert sup.run() == 1
    assert sup.failures_at_start["w0"] == [0, 1, 2, 3]  # then it gave up


def test_a_run_is_not_healthy_by_its_length() -> None:
    """A worker that crashes after each restore of more than ``idle_healthy_after`` (30
    minutes) is a crash loop: only the worker's own report (a commit, or a quiet run) makes
    a run healthy, not the time it lasted."""
    policy = RestartPolicy(initial_backoff=0.05, max_backoff=0.1, max_failures=3)
    sup = LongRuns({"w0": "import sys; sys.exit(1)"}, policy)
    sup.seconds = 2 * policy.idle_healthy_after
    assert sup.run() == 1
    assert sup.failures_at_start["w0"] == [0, 1, 2, 3]  # then it gave up


# Reports a quiet run (as report_idle_healthy does, told how long by the supervisor), then
# crashes.
QUIET_THEN_CRASHES = f"""
import os, sys
assert float(os.environ[{IDLE_HEALTHY_ENV!r}]) == 1800.0
open(os.environ[{COMMITTED_FILE_ENV!r}], "w").close()
sys.exit(1)
"""


def test_a_run_the_worker_reports_quiet_is_healthy() -> None:
    """A worker with nothing to commit reports its run healthy once quiet for the time the
    supervisor passes it: the rare crashes of a job idle for days never add up to giving up."""
    policy = RestartPolicy(initial_backoff=0.05, max_backoff=0.1, max_failures=3)
    sup = LongRuns({"w0": QUIET_THEN_CRASHES}, policy)
    sup.limit = 6
    sup.run()
    assert sup.failures_at_start["w0"] == [0, 1, 1, 1, 1, 1]  # never given up


def test_idle_healthy_after_is_read_only_under_a_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(IDLE_HEALTHY_ENV, "5")
    monkeypatch.delenv(COMMITTED_FILE_ENV, raising=False)
    assert idle_healthy_after() is None  # not supervised: nothing to report to
    path = tmp_path / "w0.committed"
    monkeypatch.setenv(COMMITTED_FILE_ENV, str(path))
    assert idle_healthy_after() == 5.0
    monkeypatch.setenv(IDLE_HEALTHY_ENV, "soon")
    assert idle_healthy_after() is None
    report_idle_healthy()
    assert path.exists()


def test_a_healthy_run_stays_healthy_when_its_file_is_removed_before_it_ends() -> None:
    """The supervisor notes a run's health while it runs: a cleaner of /tmp removing the
    file during a long run does not make the run's crash count against the worker."""
    policy = RestartPolicy(initial_backoff=0.05, max_backoff=0.1, max_failures=3)
    sup = LongRuns({"w0": COMMITS_THEN_CLEANED_THEN_CRASHES}, policy)
    sup.limit = 5
    sup.run()
    assert sup.failures_at_start["w0"] == [0, 1, 1, 1, 1]  # never given up


def test_runs_that_commit_reset_the_failures_however_short() -> None:
    policy = RestartPolicy(initial_backoff=0.05, max_backoff=0.1, max_failures=3)
    sup = LongRuns({"w0": COMMITS_THEN_CRASHES}, policy)
    sup.seconds = 0.0  # runs as short as they are: only their commits make them healthy
    sup.limit = 6
    sup.run()
    assert sup.failures_at_start["w0"] == [0, 1, 1, 1, 1, 1]  # never given up


# Sleeps with SIGTERM's default action: a child that gets SIGTERM ends with -SIGTERM at once,
# also before its interpreter is up; one that never gets it (or has it blocked) exits 3 late.
SLEEPS = "import time; time.sleep(20); raise SystemExit(3)"


@pytest.mark.parametrize("where", ["before Popen", "inside Popen"])
def test_sigterm_while_a_worker_starts_reaches_every_started_worker(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM lands while the supervisor starts w1 (before its Popen, or inside it, before
    the child is in ``children``): w0 and w1 get SIGTERM, w2 is not started, run() returns at
    once instead of when the workers exit on their own."""
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        child = real_popen(*args, **kwargs)
        started.append(child)
        if where == "inside Popen" and len(started) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return child

    class SignalledMidStart(ScriptedSupervisor):
        def _command(self, worker_id: str) -> list[str]:
            if where == "before Popen" and worker_id == "w1":
                os.kill(os.getpid(), signal.SIGTERM)
            return super()._command(worker_id)

    monkeypatch.setattr(subprocess, "Popen", popen)
    sup = SignalledMidStart({"w0": SLEEPS, "w1": SLEEPS, "w2": SLEEPS}, POLICY)
    begun = time.monotonic()
    try:
        sup.run()
    finally:
        for child in started:
            child.kill()
            child.wait()
    assert time.monotonic() - begun < 10
    assert len(started) == 2 and not sup.starts["w2"]
    assert [c.returncode for c in started] == [-signal.SIGTERM, -signal.SIGTERM]
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_sigterm_while_a_restart_is_scheduled_ends_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM between the decision to restart a worker and its scheduling: nothing is
    restarted, and run() returns instead of waiting for the restart forever."""
    real_decide = decide

    def decide_then_sigterm(*args: Any, **kwargs: Any) -> supervisor_module.Decision:
        decision = real_decide(*args, **kwargs)
        if decision.action == "restart":
            os.kill(os.getpid(), signal.SIGTERM)
        return decision

    def timed_out(*_: Any) -> None:
        raise TimeoutError("the supervisor did not return after SIGTERM")

    monkeypatch.setattr(supervisor_module, "decide", decide_then_sigterm)
    sup = ScriptedSupervisor({"w0": "import sys; sys.exit(1)"}, POLICY)
    saved = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(10)
    try:
        sup.run()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, saved)
    assert len(sup.starts["w0"]) == 1


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
