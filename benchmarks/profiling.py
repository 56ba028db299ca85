"""Running a system's process under pyinstrument and rendering where its time went."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def profiled_argv(module: str, args: list[str], session: Path) -> list[str]:
    """``python -m pyinstrument`` around ``python -m module args``, saving a session file."""
    return [sys.executable, "-m", "pyinstrument", "-r", "pyisession", "-o", str(session),
            "-m", module, *args]


def render(session: Path, timeout: float = 300.0) -> list[Path]:
    """Render a saved session as HTML (to browse) and text (to read in a log)."""
    outputs: list[Path] = []
    if not session.exists():
        return outputs
    for renderer, suffix in (("html", ".html"), ("text", ".txt")):
        out = session.with_suffix(suffix)
        done = subprocess.run(
            [sys.executable, "-m", "pyinstrument", "--load", str(session), "-r", renderer,
             "-o", str(out)], capture_output=True, timeout=timeout, check=False)
        if done.returncode == 0:
            outputs.append(out)
    return outputs
