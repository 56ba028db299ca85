"""Runs N worker processes of one job on this host and restarts the ones that crash.

Each child is ``snapline run <spec> --worker-id <base>-<i>`` (a stable id, so a restarted
worker fences its previous incarnation). SIGTERM/SIGINT are forwarded as SIGTERM to every child,
also to one being started when the signal comes (they are blocked from before its start until
it is in ``children``); the children take a final checkpoint and exit. They get SIGTERM too
when the supervisor dies by any means, SIGKILL included (Linux: ``PR_SET_PDEATHSIG``): no
orphan outlives it.

What a worker's exit code means (``decide`` is the whole policy, unit-tested alone):

- ``0``: the worker stopped cleanly (it was told to); it is not restarted.
- ``EX_CONFIG`` (78): a configuration error that no restart can fix (a missing topic, a bad
  setting). The supervisor stops every worker and exits 78; the worker's message (passed in
  the file named by ``MESSAGE_FILE_ENV``) is printed once by the CLI.
- ``EX_SUPERSEDED`` (79): a later process with this worker id runs elsewhere (the host was
  replaced while this one was frozen or cut off; or two services share the id). That worker
  is not restarted, and the others go on; the supervisor exits 79 once none is left.
- ``EX_TEMPFAIL`` (75): "restart me" (e.g. the broker is unreachable): restarted with backoff,
  never given up on.
- anything else (an exception, a signal such as SIGKILL or the OOM killer): restarted with
  backoff; after ``max_failures`` failures in a row without a healthy run the supervisor gives
  up, stops the others and exits with that code.

A run is healthy when the worker says so by creating the file named by
``COMMITTED_FILE_ENV``, however long it ran: a worker that fails the same way every time after
minutes or hours (checkpoints that time out, a crash right after a long restore) is a crash
loop, not a string of healthy runs. The worker creates it at its first committed checkpoint
(``report_committed``), or once it was quiet for ``idle_healthy_after`` (30 minutes, passed in
``IDLE_HEALTHY_ENV``): no checkpoint failed in that time and its restores' time not counted,
so nothing to commit (no partitions, no input since its last restore;
``report_idle_healthy``). The supervisor looks at the file at every poll while the worker
runs (a cleaner of /tmp may remove it before the worker exits). The rare
crashes of a job idle for days then do not add up to giving up, while a worker whose every run
ends in failures, however long it lasts, is given up on. (Before, any run of 30 minutes counted
as healthy: a worker that crashed after each restore of more than 30 minutes was restarted
without end.)

Backoff: ``initial_backoff * 2**(n-1)`` seconds before the n-th restart in a row (EX_TEMPFAIL
included), capped at ``max_backoff``; after a healthy run it starts again from n = 1.

Threads: everything runs on the main thread (signal handlers only set a flag and forward
SIGTERM). ``report_committed`` runs in the worker process, on its task thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

#: sysexits.h: a configuration error; restarting cannot help.
EX_CONFIG = 78
#: sysexits.h: a temporary failure; restart the worker (it recovers from its checkpoint).
EX_TEMPFAIL = 75
#: Snapline's own: a later process with this worker id took over elsewhere
#: (runtime/incarnation.py). This worker is not restarted; the others go on.
EX_SUPERSEDED = 79
#: A supervised worker writes the message of its EX_CONFIG exit to this file (the
#: supervisor prints it once instead of every worker printing it).
MESSAGE_FILE_ENV = "SNAPLINE_SUPERVISOR_MESSAGE_FILE"
#: A supervised worker creates this file at its first committed checkpoint: its run is then
#: healthy (``report_committed``).
COMMITTED_FILE_ENV = "SNAPLINE_SUPERVISOR_COMMITTED_FILE"
#: Seconds a supervised worker must be quiet (nothing to commit, nothing failing) in a row
#: before its run is healthy without a committed checkpoint (``report_idle_healthy``).
IDLE_HEALTHY_ENV = "SNAPLINE_SUPERVISOR_IDLE_HEALTHY_AFTER"
POLL_INTERVAL = 0.2
#: The supervisor tells a worker how often it restarted it (its snapline_worker_restarts).
RESTARTS_ENV = "SNAPLINE_WORKER_RESTARTS"


#: prctl(2): the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1
#: The signals that stop the supervisor (and, forwarded as SIGTERM, its workers).
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})


def report_committed(checkpoints_committed: int) -> None:
    """Tell the supervisor that this worker's run is healthy. A worker calls it after every
    committed checkpoint with the number it committed since it started; only the first call
    does anything (creates the file named by ``COMMITTED_FILE_ENV``, when a supervisor set it).
    A failure to create it is logged, not raised: the run then only counts as unhealthy."""
    if checkpoints_committed != 1:
        return
    path = os.environ.get(COMMITTED_FILE_ENV)
    if not path:
        return  # not started by a supervisor
    try:
        _touch(Path(path))
    except OSError as exc:
        log.warning("could not tell the supervisor of the first committed checkpoint: %s", exc)


def hand_over_message(text: str) -> bool:
    """Write a supervised worker's configuration-error message (already redacted) to the file
    named by ``MESSAGE_FILE_ENV``, for the supervisor to print once; False when no supervisor
    asked for it. Its directory is made again if a cleaner of /tmp removed it."""
    path = os.environ.get(MESSAGE_FILE_ENV)
    if not path:
        return False
    Path(path).parent.mkdir(exist_ok=True)
    Path(path).write_text(text)
    return True


def _touch(path: Path) -> None:
    """Create ``path``, and its directory if a cleaner of /tmp removed it (by age, during a
    long run)."""
    path.parent.mkdir(exist_ok=True)
    path.touch()


def idle_healthy_after() -> float | None:
    """Seconds a supervised worker must be quiet before its run is healthy without a
    committed checkpoint; None when no supervisor asked (or its value is not a number)."""
    try:
        return float(os.environ[IDLE_HEALTHY_ENV]) if os.environ.get(COMMITTED_FILE_ENV) else None
    except (KeyError, ValueError):
        return None


def report_idle_healthy() -> None:
    """Tell the supervisor that this worker's run is healthy although it committed nothing:
    it was quiet (no restore running, no checkpoint failed) for ``idle_healthy_after()``
    seconds in a row. Creates the file of ``report_committed``; a failure is logged."""
    path = os.environ.get(COMMITTED_FILE_ENV)
    if not path:
        return
    try:
        _touch(Path(path))
    except OSError as exc:
        log.warning("could not tell the supervisor that this worker is idle and well: %s", exc)


def _stop_with_parent(parent: int) -> Callable[[], None]:
    """Run in a child between fork and exec (Linux): SIGTERM it when the supervisor dies.

    Without it a supervisor killed with SIGKILL (the OOM killer, an impatient service
    manager) leaves its workers running as orphans; the next supervisor's workers of the same
    ids then find them holding their local directories (``runtime.local_lock``) and fenced
    by them in Kafka. SIGTERM, not SIGKILL: the orphan takes its final checkpoint and exits
    within the worker's STOP_BOUND, which the successor's lock wait covers."""

    try:  # looked up here, in the parent: the child between fork and exec only calls it
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: children outlive a killed supervisor
        prctl = None

    def preexec() -> None:
        if prctl is None:
            return
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os._exit(EX_TEMPFAIL)

    return preexec


def _worker_preexec(parent: int, mask: Iterable[int]) -> Callable[[], None]:
    """Run in a worker between fork and exec: ``_stop_with_parent``, then the stop signals,
    blocked in the supervisor while it starts the worker, unblocked again (the mask would
    survive exec, and the worker would never see SIGTERM). Their dispositions are reset first:
    the supervisor's Python handler, inherited until exec, must not run in the child, and a
    stop signal already pending ends the child before exec, like one a moment after it."""

    stop_with_parent = _stop_with_parent(parent)

    def preexec() -> None:
        stop_with_parent()
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    return preexec


@dataclass(frozen=True)
class RestartPolicy:
    """How eagerly crashed workers are restarted."""

    initial_backoff: float = 1.0
    max_backoff: float = 30.0
    #: A worker quiet this long in a row (no restore running, no checkpoint failed: nothing
    #: to commit) reports its run healthy without a committed checkpoint.
    idle_healthy_after: float = 1800.0
    #: Failures in a row (without a healthy run, EX_TEMPFAIL excepted) before giving up.
    max_failures: int = 5


@dataclass(frozen=True)
class Decision:
    """What to do about one worker's exit."""

    action: Literal["restart", "done", "stop_all"]
    #: Failures in a row of this worker, including this one (0 after a clean exit).
    failures: int = 0
    #: Seconds to wait before the restart.
    delay: float = 0.0
    #: The supervisor's exit code when ``action`` is "stop_all".
    exit_code: int = 0
    reason: str = ""


def decide(
    code: int, healthy: bool, failures_before: int, policy: RestartPolicy, stopping: bool
) -> Decision:
    """The restart policy of the module docstring, for a worker that exited with ``code``
    after a run that was ``healthy`` (it committed a checkpoint) or not, having failed
    ``failures_before`` times in a row before it."""
    if stopping:
        return Decision("done", exit_code=code, reason="stopping")
    if code == 0:
        return Decision("done", reason="exited cleanly; not restarted")
    if code == EX_SUPERSEDED:
        return Decision(
            "done",
            exit_code=EX_SUPERSEDED,
            reason="was replaced by a later process with its worker id; not restarted",
        )
    if code == EX_CONFIG:
        return Decision(
            "stop_all",
            exit_code=EX_CONFIG,
            reason="configuration error, which a restart cannot fix",
        )
    failures = (0 if healthy else failures_before) + 1
    if code != EX_TEMPFAIL and failures > policy.max_failures:
        return Decision(
            "stop_all",
            failures=failures,
            exit_code=code if code > 0 else 1,
            reason=f"failed {failures} times in a row without committing a checkpoint; giving up",
        )
    delay = min(policy.max_backoff, policy.initial_backoff * 2 ** (failures - 1))
    what = "asked to be restarted" if code == EX_TEMPFAIL else "crashed"
    return Decision(
        "restart",
        failures=failures,
        delay=delay,
        reason=f"{what} (failure {failures} in a row); restarting in {delay:g} s",
    )


class Supervisor:
    """Starts the workers, applies ``decide`` to every exit, forwards SIGTERM/SIGINT."""

    def __init__(
        self,
        spec: str,
        worker_ids: Sequence[str],
        extra_args: Sequence[str],
        policy: RestartPolicy | None = None,
        metrics_port: int | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.spec = spec
        #: Set in every worker's environment (settings that must not show on a command line).
        self.extra_env = dict(extra_env or {})
        #: Worker i serves its metrics on metrics_port + i.
        self.metrics_port = metrics_port
        self.restarts: dict[str, int] = {w: 0 for w in worker_ids}
        self.worker_ids = list(worker_ids)
        self.extra_args = list(extra_args)
        self.policy = policy or RestartPolicy()
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.started_at: dict[str, float] = {}
        self.failures: dict[str, int] = {w: 0 for w in worker_ids}
        #: Worker id -> monotonic time of its scheduled restart.
        self.restart_due: dict[str, float] = {}
        #: The message of the configuration error that stopped the job (printed by the CLI).
        self.failure_message: str | None = None
        self._stopping = False
        self._messages = Path(tempfile.mkdtemp(prefix="snapline-supervisor-"))
        #: Whether each worker's current run was seen healthy (its file, looked at every poll:
        #: a cleaner of /tmp may remove it before the worker exits).
        self.healthy: dict[str, bool] = {}

    def _command(self, worker_id: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "snapline.pipeline.cli",
            "run",
            self.spec,
            "--worker-id",
            worker_id,
            *self.extra_args,
            *(
                ["--metrics-port", str(self._metrics_port_of(worker_id))]
                if self.metrics_port is not None
                else []
            ),
        ]

    def _metrics_port_of(self, worker_id: str) -> int:
        """metrics_port + i for worker i; 0 (any free port) for every worker."""
        assert self.metrics_port is not None
        if self.metrics_port == 0:
            return 0
        return self.metrics_port + self.worker_ids.index(worker_id)

    def _message_file(self, worker_id: str) -> Path:
        return self._messages / f"{worker_id}.message"

    def _committed_file(self, worker_id: str) -> Path:
        return self._messages / f"{worker_id}.committed"

    def _start(self, worker_id: str) -> None:
        """Start the worker, unless the supervisor is stopping. A stop signal that comes
        meanwhile waits (blocked) until the child is in ``children``, where ``stop`` finds it."""
        # A cleaner of /tmp (by age: systemd-tmpfiles) may have removed it during a long run.
        self._messages.mkdir(parents=True, exist_ok=True)
        self._message_file(worker_id).unlink(missing_ok=True)
        self._committed_file(worker_id).unlink(missing_ok=True)
        self.healthy[worker_id] = False
        env = {
            **os.environ,
            **self.extra_env,
            MESSAGE_FILE_ENV: str(self._message_file(worker_id)),
            COMMITTED_FILE_ENV: str(self._committed_file(worker_id)),
            IDLE_HEALTHY_ENV: repr(self.policy.idle_healthy_after),
            RESTARTS_ENV: str(self.restarts[worker_id]),
        }
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            if self._stopping:
                return
            child = subprocess.Popen(
                self._command(worker_id),
                env=env,
                preexec_fn=_worker_preexec(os.getpid(), mask),
            )
            self.children[worker_id] = child
            self.started_at[worker_id] = time.monotonic()
            if self._stopping:
                # stop() ran inside Popen, before the child was in children (a signal that
                # came before the block, its Python handler run late)
                child.send_signal(signal.SIGTERM)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        log.info("started worker %s (pid %d)", worker_id, child.pid)

    def stop(self, *_: Any) -> None:
        self._stopping = True
        self.restart_due.clear()
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        try:
            return self._run()
        finally:
            for path in self._messages.glob("*"):
                path.unlink(missing_ok=True)
            self._messages.rmdir()

    def _run(self) -> int:
        for worker_id in self.worker_ids:
            if self._stopping:
                break
            self._start(worker_id)
        exit_code = 0
        while self.children or self.restart_due:
            time.sleep(POLL_INTERVAL)
            now = time.monotonic()
            if self._stopping:
                # a restart scheduled after stop() cleared them (a signal between decide and
                # the scheduling) would otherwise keep this loop going forever
                self.restart_due.clear()
            for worker_id, due in list(self.restart_due.items()):
                # pop, not del: a stop signal meanwhile empties restart_due
                if now >= due and self.restart_due.pop(worker_id, None) is not None:
                    self._start(worker_id)
            for worker_id, child in list(self.children.items()):
                code = child.poll()
                if not self.healthy.get(worker_id):
                    self.healthy[worker_id] = self._committed_file(worker_id).exists()
                if code is None:
                    continue
                del self.children[worker_id]
                ran_for = now - self.started_at[worker_id]
                healthy = self.healthy[worker_id]
                decision = decide(
                    code, healthy, self.failures[worker_id], self.policy, self._stopping
                )
                self.failures[worker_id] = decision.failures
                if decision.action == "restart":
                    log.warning(
                        "worker %s exited with %s after %.0f s (%s): %s",
                        worker_id,
                        code,
                        ran_for,
                        "healthy" if healthy else "no checkpoint committed",
                        decision.reason,
                    )
                    self.restart_due[worker_id] = now + decision.delay
                    self.restarts[worker_id] += 1
                elif decision.action == "stop_all":
                    if code == EX_CONFIG and self.failure_message is None:
                        self.failure_message = self._read_message(worker_id)
                    if not self._stopping:
                        log.error(
                            "worker %s exited with %s: %s; stopping all workers",
                            worker_id,
                            code,
                            decision.reason,
                        )
                        self.stop()
                    exit_code = exit_code or decision.exit_code
                else:
                    if code == EX_SUPERSEDED and not self._stopping:
                        log.error("worker %s: %s", worker_id, self._read_message(worker_id))
                    if decision.reason != "stopping":
                        log.info("worker %s %s", worker_id, decision.reason)
                    exit_code = exit_code or decision.exit_code
        return exit_code

    def _read_message(self, worker_id: str) -> str:
        try:
            return self._message_file(worker_id).read_text().strip()
        except FileNotFoundError:
            return f"worker {worker_id} exited with a configuration error (see its log above)"
