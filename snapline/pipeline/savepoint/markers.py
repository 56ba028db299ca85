"""The job's savepoint-restore markers, which every worker reads at start: kept apart from
``restore`` (which imports pyarrow and numpy, ~0.4 s of a worker's start) so that a worker's
start does not import what only a restore uses."""

from __future__ import annotations

from typing import Any

from snapline.pipeline.checkpoint.metadata import decode_checked, encode_checked
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, ConfigurationError

__all__ = [
    "REPARTITION_TOPICS",
    "RESTORED_FROM",
    "RESTORING",
    "check_no_interrupted_restore",
    "read_topic_generations",
    "restore_group",
    "use_topic_generations",
    "write_topic_generations",
]

RESTORED_FROM = "restored-from-savepoint.json"
#: Written before a restore's first change to Kafka, removed once it is complete: a restore
#: that died between leaves the job's repartition topics and offsets half-done, and workers
#: refuse to start until a restore from a savepoint completes (``check_no_interrupted_restore``).
RESTORING = "restore-in-progress.json"
#: ``key_by`` name -> the generation of its repartition topic (``stages.repartition_topic``),
#: written by a savepoint restore that replaced a topic (before it changes any), read by every
#: worker at start and by whatever compiles the job's stages against Kafka. Missing: every
#: topic is of generation 0.
REPARTITION_TOPICS = "repartition-topics.json"


def check_no_interrupted_restore(storage: CheckpointStorage, job: str) -> None:
    """Refuse (ConfigurationError) a job whose last savepoint restore changed Kafka and did not
    complete: its repartition topics were emptied, and its offsets may still name the old
    checkpoints, whose positions in them mean nothing now (records would be skipped or read
    twice)."""
    path = f"{job}/{RESTORING}"
    if not storage.exists(path):
        return
    what = storage.full_path(path)
    try:
        uri = decode_checked(storage.read_bytes(path), what, "savepoint")["savepoint"]
    except (CheckpointError, KeyError):
        uri = "<unreadable: see the file>"
    raise ConfigurationError(
        f"the restore of job {job!r} from savepoint {uri} stopped after it had changed Kafka "
        f"({what} is left): the job's repartition topics and offsets are half-done. Finish "
        f"it: start a worker with --from-savepoint {uri} (the same savepoint), or restore "
        "another savepoint"
    )


def restore_group(job: str) -> str:
    """The consumer group whose one member a restore of ``job`` is while it runs (a '/' no
    job name has: it is no job's group)."""
    return f"{job}/restore"


def read_topic_generations(storage: CheckpointStorage, job: str) -> dict[str, int]:
    """The job's repartition topic generations (empty: none was replaced). A corrupt file is
    refused (CheckpointError): the job would write and read topics it no longer uses."""
    path = f"{job}/{REPARTITION_TOPICS}"
    if not storage.exists(path):
        return {}
    body = decode_checked(storage.read_bytes(path), storage.full_path(path))
    try:
        return {str(name): int(generation) for name, generation in body["generations"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{storage.full_path(path)} is not valid: {exc!r}") from exc


def write_topic_generations(
    storage: CheckpointStorage, job: str, generations: dict[str, int]
) -> None:
    storage.write_bytes(
        f"{job}/{REPARTITION_TOPICS}",
        encode_checked({"generations": dict(sorted(generations.items()))}),
    )


def use_topic_generations(pipeline: Any, storage: CheckpointStorage) -> None:
    """Give ``pipeline`` its job's repartition topic generations, before its stages are
    compiled against the job's Kafka topics."""
    pipeline.topic_generations = read_topic_generations(storage, pipeline.name)
