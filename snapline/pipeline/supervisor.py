"""Runs N worker processes of one job on this host and restarts the ones that crash.

Each child is ``snapline run <spec> --worker-id <base>-<i>`` (a stable id, so a restarted
worker fences its previous incarnation). SIGTERM/SIGINT are forwarded; the children take a
final checkpoint and exit.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

RESTART_BACKOFF = 1.0
MAX_RESTARTS_PER_MINUTE = 10


class Supervisor:
    def __init__(self, spec: str, worker_ids: Sequence[str], extra_args: Sequence[str]) -> None:
        self.spec = spec
        self.worker_ids = list(worker_ids)
        self.extra_args = list(extra_args)
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: dict[str, list[float]] = {w: [] for w in worker_ids}
        self._stopping = False

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
        ]

    def _start(self, worker_id: str) -> None:
        self.children[worker_id] = subprocess.Popen(self._command(worker_id))
        log.info("started worker %s (pid %d)", worker_id, self.children[worker_id].pid)

    def stop(self, *_: Any) -> None:
        self._stopping = True
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        for worker_id in self.worker_ids:
            self._start(worker_id)
        exit_code = 0
        while self.children:
            time.sleep(0.2)
            for worker_id, child in list(self.children.items()):
                code = child.poll()
                if code is None:
                    continue
                del self.children[worker_id]
                if self._stopping:
                    exit_code = exit_code or code
                    continue
                now = time.monotonic()
                recent = [t for t in self.restarts[worker_id] if now - t < 60] + [now]
                self.restarts[worker_id] = recent
                if len(recent) > MAX_RESTARTS_PER_MINUTE:
                    log.error(
                        "worker %s crashed %d times in a minute; giving up", worker_id, len(recent)
                    )
                    self.stop()
                    exit_code = code or 1
                    continue
                log.warning("worker %s exited with %s; restarting", worker_id, code)
                time.sleep(RESTART_BACKOFF)
                self._start(worker_id)
        return exit_code
