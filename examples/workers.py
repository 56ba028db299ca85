"""Real worker processes for the demo and the integration tests: start, SIGKILL, SIGSTOP,
restart, and read their metrics events."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: The start of the log line of a worker that died of a fatal signal nobody sent it.
DIED_OF_SIGNAL = "===== the worker died of a signal the test did not send: "
#: Signals a process gets for a fault of its own (a bad memory access, an abort()).
FATAL_SIGNALS = {
    signal.SIGSEGV,
    signal.SIGABRT,
    signal.SIGBUS,
    signal.SIGILL,
    signal.SIGFPE,
}


def run_snapline(
    *args: str, cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``snapline ARGS`` (the CLI of this checkout) in the foreground, its output captured,
    with ``env`` over this process's environment; bounded by ``timeout`` s, so a test never
    waits forever."""
    return subprocess.run(
        [sys.executable, "-m", "snapline.pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=with_repo_path({**os.environ, **env}),
    )


def with_repo_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this checkout first on ``PYTHONPATH``, ahead of what it had there (a
    side-installed client library, e.g. to run the tests on another confluent-kafka)."""
    path = [str(REPO), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


def child_pythonpath() -> str:
    """``PYTHONPATH`` for a child process: this checkout, then this process's own (so that
    ``PYTHONPATH=<another confluent-kafka> bash scripts/test`` runs every process on it)."""
    return with_repo_path(dict(os.environ))["PYTHONPATH"]


class WorkerProcess:
    """One ``snapline run`` worker with a stable worker id; restartable after a kill."""

    def __init__(
        self,
        spec: str,
        worker_id: str,
        bootstrap: str,
        checkpoint_dir: Path,
        workdir: Path,
        env: dict[str, str],
    ) -> None:
        self.spec = spec
        self.worker_id = worker_id
        self.bootstrap = bootstrap
        self.checkpoint_dir = checkpoint_dir
        self.workdir = workdir
        self.env = dict(env)
        self.proc: subprocess.Popen[bytes] | None = None
        #: Whether this process was sent a signal (by ``signal``, ``kill``, ``stop``).
        self._signalled = False
        self.starts = 0
        self.log_path = workdir / f"worker-{worker_id}.log"
        self.metrics_path = workdir / "metrics.jsonl"
        self.fault_log = workdir / "faults.log"

    def _args(self, extra_args: list[str] | None) -> list[str]:
        return [
            "run",
            self.spec,
            "--bootstrap-servers",
            self.bootstrap,
            "--checkpoint-dir",
            str(self.checkpoint_dir),
            "--worker-id",
            self.worker_id,
            *(extra_args or []),
        ]

    def _env(self, extra_env: dict[str, str] | None) -> dict[str, str]:
        return with_repo_path(
            {
                **os.environ,
                **self.env,
                **(extra_env or {}),
                "SNAPLINE_METRICS_FILE": str(self.metrics_path),
                "SNAPLINE_FAULT_LOG": str(self.fault_log),
            }
        )

    def start(
        self, extra_env: dict[str, str] | None = None, extra_args: list[str] | None = None
    ) -> None:
        self._note_own_end()
        self._signalled = False
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {self.starts} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "snapline.pipeline.cli", *self._args(extra_args)],
                cwd=str(self.workdir),
                env=self._env(extra_env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        log.close()
        self.starts += 1

    def run_once(
        self, extra_args: list[str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run the worker in the foreground, its output captured: for a worker expected to
        refuse to start (bounded by ``timeout`` s, so a test never waits forever)."""
        return run_snapline(
            *self._args(extra_args), cwd=self.workdir, env=self._env(None), timeout=timeout
        )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signalled = True
            os.kill(self.proc.pid, sig)

    def _note_own_end(self) -> None:
        """A process that died of a fatal signal this object did not send (``FATAL_SIGNALS``)
        leaves a line saying so in its log, which the integration suite's fatal-signal check
        reads: faulthandler does not always get to write its report. A SIGKILL is not one:
        fault injection's kill points end a worker with it."""
        code = None if self.proc is None else self.proc.poll()
        if code is not None and -code in FATAL_SIGNALS and not self._signalled:
            self._signalled = True  # noted once
            with open(self.log_path, "ab") as log:
                log.write(f"\n{DIED_OF_SIGNAL}{signal.Signals(-code).name}\n".encode())

    def kill(self) -> None:
        """SIGKILL: no final checkpoint, no cleanup; crash consistency is the point."""
        self._note_own_end()
        if self.proc is not None:
            self.signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM: final checkpoint and a clean exit."""
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def wait_exit(self, timeout: float) -> int:
        """The exit code of a worker expected to stop by itself (AssertionError after
        ``timeout`` s, so a test never waits forever for a worker that keeps running)."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {self.worker_id} still running after {timeout} s\n{self.tail()}"
            ) from None

    def tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def process_state(pid: int) -> str | None:
    """The one-letter state of /proc/<pid>/stat (T = stopped, Z = zombie); None: no such
    process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie its parent has not reaped yet counts as gone; an
    orphan's new parent may never reap it)."""
    return process_state(pid) in (None, "Z", "X")


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by SIGKILL
    return events


def fault_hits(path: Path) -> dict[str, int]:
    hits: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                hits[parts[2]] = hits.get(parts[2], 0) + 1
    return hits
