"""Another confluent-kafka release for the tests, installed beside the one in use.

CI installs the oldest dependencies the extras resolve to (Quix Streams in ``bench`` holds
confluent-kafka below 2.13), while ``pip install snapline`` alone takes the newest release the
pin admits. Tests that start workers on :data:`NEWEST` cover the other end of the range: the
release is installed once from PyPI into Snapline's cache (``--target``, no dependencies) and
put first on the workers' ``PYTHONPATH``.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

from snapline.connectors.local.broker import cache_dir

#: The newest confluent-kafka release pyproject.toml's range admits; raise it with the pin
#: (tests/test_client_pin.py checks that the two agree).
NEWEST = "2.16.1"


def side_installed(version: str = NEWEST) -> Path:
    """A directory that holds confluent-kafka ``version`` (for ``PYTHONPATH``); installed
    with pip on first use, concurrent callers waiting for each other."""
    home = cache_dir() / "clients" / f"confluent-kafka-{version}"
    if (home / ".complete").exists():
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    with (home.parent / ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (home / ".complete").exists():  # another process finished while we waited
            return home
        partial = home.with_name(home.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--disable-pip-version-check",
                "--target",
                str(partial),
                f"confluent-kafka=={version}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"pip could not install confluent-kafka=={version} into {partial} (the tests "
                f"need it from PyPI once):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
        shutil.rmtree(home, ignore_errors=True)
        partial.rename(home)
        (home / ".complete").touch()
    return home
