"""Starts the Snapline CLI in this process (``python -m benchmarks.snapline_entry run ...``),
so the harness and pyinstrument can launch a worker the same way whether or not the
``snapline`` console script is installed.

``--profile-to PATH`` (first argument): profile the worker with pyinstrument in-process and
save the session to PATH when it exits. The worker ends with ``os._exit`` (librdkafka's
destructors may block), which skips the atexit hook that ``python -m pyinstrument`` saves
its session in, so the harness's outer profiler would write an empty file.
"""

from __future__ import annotations

import sys
from pathlib import Path


def _profile_until_exit(session: Path) -> None:
    """Start profiling; save the session just before the worker's ``_exit_now``."""
    from pyinstrument import Profiler

    from snapline.pipeline.runtime import worker

    profiler = Profiler()
    original = worker._exit_now

    def save_then_exit(code: int) -> None:
        profiler.stop()
        if profiler.last_session is not None:
            profiler.last_session.save(str(session))
        original(code)

    worker._exit_now = save_then_exit  # looked up at call time by run_worker
    profiler.start()


def main() -> None:
    profile_to: Path | None = None
    if sys.argv[1:2] == ["--profile-to"]:
        profile_to = Path(sys.argv[2])
        sys.argv = [sys.argv[0], *sys.argv[3:]]
    try:
        from snapline.pipeline.cli import main as snapline_main
    except ImportError as exc:
        sys.exit(
            f"the Snapline runtime is not available yet (snapline.pipeline.cli: {exc}); "
            "run the benchmark with --only baseline-a,baseline-b,quix"
        )
    if profile_to is not None:
        _profile_until_exit(profile_to)
    snapline_main()


if __name__ == "__main__":
    main()
