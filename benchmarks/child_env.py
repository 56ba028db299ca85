"""The contract between the harness and a benchmarked system's process: environment variables in,
a start-of-consumption file and a stats file out.

Every system (baselines, Quix Streams, Snapline) runs in its own process and reads its topics,
group and file paths from ``BENCH_*`` variables, so one launcher serves all of them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

_PREFIX = "BENCH_"
_OPTIONAL = ("commit_interval", "backend", "guarantee")


@dataclass(frozen=True)
class ChildEnv:
    """What one benchmarked process needs to know."""

    bootstrap: str
    in_topic: str
    out_topic: str
    group: str
    start_file: str
    stats_file: str
    state_dir: str
    commit_interval: float = 1.0
    backend: str = "memory"
    guarantee: str = "exactly_once"

    def to_environ(self) -> dict[str, str]:
        return {_PREFIX + k.upper(): str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> ChildEnv:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = _PREFIX + f.name.upper()
            if name in env:
                values[f.name] = float(env[name]) if f.name == "commit_interval" else env[name]
        missing = [
            _PREFIX + f.name.upper()
            for f in fields(cls)
            if f.name not in values and f.name not in _OPTIONAL
        ]
        if missing:
            raise SystemExit(
                f"benchmark child started without {', '.join(missing)}; "
                "it is meant to be launched by `python -m benchmarks`"
            )
        return cls(**values)


class StartMarker:
    """Writes the wall-clock time of the first consumed record to a file, once per process.

    The file is created with O_EXCL, so copies of the marker (one per task) race safely and
    the earliest writer wins.
    """

    __slots__ = ("_path", "done")

    def __init__(self, path: str) -> None:
        self._path = path
        self.done = False

    def mark(self) -> None:
        if self.done:
            return
        self.done = True
        now = time.time()
        try:
            fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as fh:
            fh.write(repr(now))


def read_start_time(path: str | Path) -> float | None:
    """The time written by StartMarker, or None while the system has not consumed anything."""
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return None
    try:
        return float(text)
    except ValueError:  # written but not flushed yet
        return None


def write_stats(path: str, stats: dict[str, Any]) -> None:
    """Atomically write the child's own measurements (commit durations, counters)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(stats, fh)
    os.replace(tmp, path)


def read_stats(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
