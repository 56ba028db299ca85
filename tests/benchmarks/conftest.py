"""Makes the repository's ``benchmarks`` package importable when pytest is run as ``pytest``
(``python -m pytest`` already has the working directory on the path)."""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
