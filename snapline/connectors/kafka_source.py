"""The Kafka source declaration: topics, formats and where to start without a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.formats import FORMATS

STARTING_POSITIONS = ("earliest", "latest")


@dataclass(frozen=True)
class KafkaSource:
    """Reads one or more co-partitioned topics.

    Records are read ``read_committed``. Without a committed checkpoint a partition starts at
    ``starting_position``; with one it starts at the checkpoint's barrier position.
    ``create_partitions`` creates missing topics (handy with the embedded broker).
    """

    topics: tuple[str, ...] | str
    value_format: str = "json"
    key_format: str = "string"
    starting_position: str = "earliest"
    create_partitions: int | None = None

    def __post_init__(self) -> None:
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
