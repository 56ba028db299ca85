"""Starts the Snapline CLI in this process (``python -m benchmarks.snapline_entry run ...``),
so the harness and pyinstrument can launch a worker the same way whether or not the
``snapline`` console script is installed."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from snapline.pipeline.cli import main as snapline_main
    except ImportError as exc:
        sys.exit(
            f"the Snapline runtime is not available yet (snapline.pipeline.cli: {exc}); "
            "run the benchmark with --only baseline-a,baseline-b,quix"
        )
    snapline_main()


if __name__ == "__main__":
    main()
