"""The harness's readings of /proc: the machine's CPU split and the main threads' waits."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.process import machine_cpu, tree_main_waits

SPIN = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass\n"


def test_steal_is_part_of_busy_which_is_part_of_total() -> None:
    busy, total, steal = machine_cpu()
    assert 0 <= steal <= busy <= total


def test_main_threads_wait_for_a_cpu_when_more_want_one_than_there_are_cores() -> None:
    """More spinning children than cores: each main thread must wait part of the time; the
    waits of the caller's descendants are counted (a supervisor's workers)."""
    before = tree_main_waits(os.getpid())
    children = [
        subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range((os.cpu_count() or 1) + 2)
    ]
    try:
        time.sleep(1.0)
        waited = tree_main_waits(os.getpid()) - before
    finally:
        for child in children:
            child.wait(timeout=30)
    assert waited > 0.1
