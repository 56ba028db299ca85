"""Event time in the API: durations and timestamps as integer milliseconds (Kafka's unit).

Every event-time quantity (record timestamps, window sizes, out-of-orderness, allowed
lateness) is an int of milliseconds or a ``datetime.timedelta``; wall-clock settings (the
idle-partition timeout) are seconds, like ``checkpoint_interval``.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any

from snapline.pipeline.errors import ConfigurationError


def duration_ms(value: Any, what: str, *, minimum: int = 0) -> int:
    """``value`` (int milliseconds or timedelta) as int milliseconds, at least ``minimum``."""
    if isinstance(value, timedelta):
        ms = value // timedelta(milliseconds=1)
    elif isinstance(value, int) and not isinstance(value, bool):
        ms = value
    else:
        raise ConfigurationError(
            f"{what}={value!r} must be an int of milliseconds or a datetime.timedelta"
        )
    if ms < minimum:
        raise ConfigurationError(f"{what}={value!r} must be at least {minimum} ms")
    return int(ms)


def seconds(value: Any, what: str) -> float | None:
    """``value`` (seconds, a timedelta or None) as float seconds > 0, or None."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ConfigurationError(f"{what}={value!r} must be seconds > 0 (or None to disable)")
    return float(value)


#: The event times a record may have: Kafka timestamps are signed 64-bit milliseconds, and a
#: window's end or a timer past the time must fit as well (±2**62 ms: ±146 million years).
_EVENT_TIME_RANGE = (-(1 << 62), 1 << 62)


def timestamp_ms(value: Any) -> int:
    """An event timestamp returned by a user's ``timestamp=`` function, as int milliseconds
    (a record with any other answer goes to the dead letters). Values beyond ±2**62 are
    refused: beyond 64 bits they failed every checkpoint at the barrier, and near it the
    windows' ends overflowed after the watermark had already jumped there for good."""
    if isinstance(value, float) and math.isfinite(value):
        value = int(value)
    elif isinstance(value, datetime):
        value = int(value.timestamp() * 1000)
    elif not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(
            f"timestamp function returned {value!r}; return int milliseconds since the epoch "
            "(or a timezone-aware datetime)"
        )
    if not _EVENT_TIME_RANGE[0] <= value <= _EVENT_TIME_RANGE[1]:
        raise ValueError(
            f"timestamp function returned {value}, beyond ±2**62 ms (an event time's windows "
            "and timers must fit 64-bit milliseconds); return milliseconds since the epoch"
        )
    return int(value)
