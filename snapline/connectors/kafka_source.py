"""The Kafka source declaration: topics, formats and where to start without a checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.formats import FORMATS
from snapline.pipeline.time import duration_ms, seconds

STARTING_POSITIONS = ("earliest", "latest")


@dataclass(frozen=True)
class KafkaSource:
    """Reads one or more co-partitioned topics.

    Records are read ``read_committed``. Without a committed checkpoint a partition starts at
    ``starting_position``; with one it starts at the checkpoint's barrier position.

    Snapline does not create the topics it reads: a missing topic stops the worker at start
    with an error naming it, unless ``create_partitions=N`` is given, which creates missing
    topics with N partitions (handy with the embedded broker). Existing topics are used as
    they are. A KafkaSink's missing topic, by contrast, is created (see its docstring and
    ``snapline.pipeline.runtime.topics``).

    Event time (docs/time.md): a record's timestamp is the Kafka record timestamp (ms), or
    ``timestamp(value)`` when given. Each partition's watermark trails the largest timestamp
    seen by ``max_out_of_orderness`` (ms or timedelta); a partition with nothing to read for
    ``idle_timeout`` seconds stops holding the watermark back (None: never).
    """

    topics: tuple[str, ...] | str
    value_format: str = "json"
    key_format: str = "string"
    starting_position: str = "earliest"
    create_partitions: int | None = None
    timestamp: Callable[[Any], Any] | None = None
    max_out_of_orderness: int | timedelta = 0
    idle_timeout: float | timedelta | None = 30.0

    def __post_init__(self) -> None:
        if self.timestamp is not None and not callable(self.timestamp):
            raise ConfigurationError(
                f"KafkaSource timestamp={self.timestamp!r} must be a function of the value "
                "returning int milliseconds"
            )
        object.__setattr__(
            self,
            "max_out_of_orderness",
            duration_ms(self.max_out_of_orderness, "max_out_of_orderness"),
        )
        object.__setattr__(self, "idle_timeout", seconds(self.idle_timeout, "idle_timeout"))
        topics = (self.topics,) if isinstance(self.topics, str) else tuple(self.topics)
        object.__setattr__(self, "topics", topics)
        if not topics or not all(isinstance(t, str) and t for t in topics):
            raise ConfigurationError(f"KafkaSource needs topic names, got {self.topics!r}")
        for fmt in (self.value_format, self.key_format):
            if fmt not in FORMATS:
                raise ConfigurationError(
                    f"KafkaSource format {fmt!r} is unknown; use one of {list(FORMATS)}"
                )
        if self.starting_position not in STARTING_POSITIONS:
            raise ConfigurationError(
                f"starting_position {self.starting_position!r} is unknown; use "
                f"{' or '.join(STARTING_POSITIONS)}"
            )

    @property
    def topic_list(self) -> tuple[str, ...]:
        return self.topics if isinstance(self.topics, tuple) else (self.topics,)
