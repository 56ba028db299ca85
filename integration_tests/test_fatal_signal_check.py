"""The suite's own check that no process of a test died of a fatal signal
(``conftest._no_process_died_of_a_fatal_signal``) sees a real segfault in a real process's log."""

from __future__ import annotations

import subprocess
import sys

import pytest

from examples.workers import DIED_OF_SIGNAL, WorkerProcess
from integration_tests.conftest import fatal_signal_reports

pytestmark = pytest.mark.integration

SEGFAULT = "import faulthandler, ctypes; faulthandler.enable(all_threads=True); ctypes.string_at(0)"


def test_a_process_that_died_of_a_segfault_is_reported_and_a_clean_one_is_not(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # Not tmp_path: the suite's check would fail this test for the segfault it makes.
    directory = tmp_path_factory.mktemp("fatal")
    for name, code in (("crashed", SEGFAULT), ("clean", "print('done')")):
        with open(directory / f"worker-{name}.log", "wb") as log:
            done = subprocess.run(
                [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, timeout=60
            )
        assert (done.returncode < 0) == (name == "crashed")
    assert fatal_signal_reports(directory) == [
        "worker-crashed.log: Fatal Python error: Segmentation fault"
    ]


def test_a_worker_found_dead_of_a_fatal_signal_is_reported_and_one_killed_is_not(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Without faulthandler's report: WorkerProcess notes a death by a fatal signal it did
    not send when it next kills or starts the worker. A SIGKILL is not noted, neither the one
    it sends nor one the worker sends itself (fault injection's kill points)."""
    directory = tmp_path_factory.mktemp("died")
    programs = {
        "crashed": "import ctypes; ctypes.string_at(0)",
        "self-killed": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        "killed": "import time; time.sleep(60)",
    }
    workers = {}
    for name, code in programs.items():
        worker = WorkerProcess("m:p", name, "127.0.0.1:1", directory, directory, {})
        worker.proc = subprocess.Popen([sys.executable, "-c", code])
        workers[name] = worker
    for name in ("crashed", "self-killed"):
        workers[name].proc.wait(60)  # type: ignore[union-attr]
    for worker in workers.values():
        worker.kill()
    assert {n: w.proc.returncode for n, w in workers.items()} == {  # type: ignore[union-attr]
        "crashed": -11,
        "self-killed": -9,
        "killed": -9,
    }
    assert fatal_signal_reports(directory) == [f"worker-crashed.log: {DIED_OF_SIGNAL}SIGSEGV"]
