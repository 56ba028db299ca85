"""Small statistics helpers: percentiles and summaries of duration lists."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest-rank percentile (``pct`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(pct / 100.0 * len(ordered))))
    return ordered[rank - 1]


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, p50, p99 and max of ``values`` (seconds in, seconds out)."""
    return {
        "count": len(values),
        "mean": statistics.fmean(values) if values else None,
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None
