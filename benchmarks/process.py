"""Launching a benchmarked system in its own process, stopping it, and reading its peak RSS.

Peak RSS is the child's ``VmHWM`` from ``/proc/<pid>/status``, sampled by a thread until the
child exits. ``ru_maxrss`` from ``wait4`` would be wrong here: Linux carries the high-water mark
of the pre-exec memory map (the harness's own, copied at fork) into the child's ru_maxrss.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Exit:
    """How a child process ended."""

    returncode: int
    peak_rss_mb: float
    wall_s: float
    stopped_by: str  # "self" | "SIGTERM" | "SIGKILL"
    log_tail: str


class Child:
    """One benchmarked process; its stdout and stderr go to ``log_path``."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env.update(env)
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in _reaped
        self.started_at = time.time()
        # Own session: a Ctrl-C meant for the harness must not hit the system mid-run (the
        # harness stops it with SIGTERM); but it dies with the harness, never orphaned.
        self._proc = subprocess.Popen(argv, env=full_env, cwd=REPO_ROOT, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=_die_with_parent(os.getpid()))
        self.pid = self._proc.pid
        self._exit: Exit | None = None
        self._hwm_kib = 0
        self._sampler = threading.Thread(target=self._sample_rss, name=f"rss-{self.pid}",
                                         daemon=True)
        self._sampler.start()

    def _sample_rss(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while self._exit is None:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self._hwm_kib = max(self._hwm_kib, int(line.split()[1]))
                        break
            except (OSError, ValueError, IndexError):  # exited (zombie: no VmHWM line)
                return
            time.sleep(0.1)

    def running(self) -> bool:
        if self._exit is not None:
            return False
        return self._try_reap(block=False) is None

    def _try_reap(self, block: bool, stopped_by: str = "self") -> Exit | None:
        if self._exit is not None:
            return self._exit
        pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return None
        self._proc.returncode = os.waitstatus_to_exitcode(status)  # keep Popen consistent
        self._log.close()
        self._exit = Exit(
            returncode=self._proc.returncode,
            peak_rss_mb=self._hwm_kib / 1024.0,
            wall_s=time.time() - self.started_at,
            stopped_by=stopped_by,
            log_tail=tail(self.log_path),
        )
        return self._exit

    def wait(self, timeout: float, stopped_by: str = "self") -> Exit | None:
        deadline = time.monotonic() + timeout
        while True:
            result = self._try_reap(block=False, stopped_by=stopped_by)
            if result is not None or time.monotonic() >= deadline:
                return result
            time.sleep(0.05)

    def stop(self, grace: float = 30.0) -> Exit:
        """SIGTERM, then SIGKILL (the whole process group) after ``grace`` seconds."""
        if self._exit is not None:
            return self._exit
        self._signal(signal.SIGTERM)
        result = self.wait(grace, stopped_by="SIGTERM")
        if result is None:
            result = self.kill()
        return result

    def kill(self) -> Exit:
        if self._exit is not None:
            return self._exit
        self._signal(signal.SIGKILL)
        result = self._try_reap(block=True, stopped_by="SIGKILL")
        assert result is not None
        return result

    def _signal(self, sig: signal.Signals) -> None:
        try:
            if sig == signal.SIGKILL:
                os.killpg(self.pid, sig)  # its helpers too
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn that has the kernel SIGKILL the child when the harness dies (Linux)."""
    def preexec() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the harness died before prctl took effect
            os._exit(1)

    return preexec


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def machine_cpu() -> tuple[float, float, float]:
    """(busy, total, steal) CPU seconds of the whole machine since boot, from ``/proc/stat``.
    Busy includes steal: time a virtual machine's CPUs wanted to run but the hypervisor ran
    something else (a quiet host shows none)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])
    steal = fields[7] if len(fields) > 7 else 0
    return (total - idle) / ticks, total / ticks, steal / ticks


def tree_main_waits(pid: int) -> float:
    """Seconds the main threads of ``pid`` and its live descendants spent runnable but waiting
    for a CPU (the second field of ``/proc/<pid>/schedstat``; 0 where the kernel has none).
    Over a window, a large share of it says the machine's cores, not a lock or the system's
    own waiting, held the task threads back."""
    waited, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            waited += int(Path(f"/proc/{p}/schedstat").read_text().split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue
    return waited / 1e9


def tree_thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid`` and its live descendants by kind of thread: ``main`` (each
    process's main thread: a Snapline worker's task thread, a baseline's loop), ``librdkafka``
    (threads named ``rdk:*``: its broker, main and queue threads, compression included) and
    ``other`` (Python's other threads: checkpoint materialization, history, liveness...)."""
    ticks = os.sysconf("SC_CLK_TCK")
    split = {"main": 0.0, "librdkafka": 0.0, "other": 0.0}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for task in Path(f"/proc/{p}").joinpath("task").iterdir():
                stat = (task / "stat").read_text()
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                fields = stat.rsplit(")", 1)[1].split()
                seconds = (int(fields[11]) + int(fields[12])) / ticks
                kind = "main" if task.name == str(p) else (
                    "librdkafka" if name.startswith("rdk:") else "other")
                split[kind] += seconds
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue
    return split


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every live descendant (a supervisor's
    workers), from ``/proc``; 0 for what has exited."""
    ticks = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue
    return total

