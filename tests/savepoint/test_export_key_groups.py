"""A savepoint labels a keyed task's state with the key-groups the task owned when its
checkpoint was taken, not with those its partition number owns at today's task count."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from snapline.pipeline.checkpoint.metadata import CheckpointRef
from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.savepoint.export import ExportJob


def _job(partition: int, stage_tasks: int | None, max_parallelism: int = 128) -> ExportJob:
    return ExportJob(
        job="j",
        task_id=f"s1-p{partition}",
        ref=CheckpointRef(3, "abcd1234"),
        checkpoint_dir="/nowhere",
        target="/nowhere/sp",
        scratch="/nowhere/scratch",
        backend="memory",
        backend_options={},
        operator_uids={},
        partition=partition,
        stage_tasks=stage_tasks,
        max_parallelism=max_parallelism,
    )


def _meta(task_count: int | None) -> Any:
    return SimpleNamespace(task_count=task_count)


def test_a_task_of_a_stage_grown_by_hand_keeps_the_key_groups_of_its_checkpoint() -> None:
    """A repartition topic of 2 partitions got 2 more by hand (the worker refuses to run on
    and names a savepoint as the fix): task 1's checkpoint holds key-groups 64..127, and was
    labelled 32..63, the range of partition 1 of 4. A restore at 2 tasks then loaded nothing
    for 64..127: half the keyed state gone without an error."""
    job = _job(partition=1, stage_tasks=4)
    assert job.key_groups(_meta(task_count=2)) == (64, 127)
    assert job.file_name("sum", (64, 127)) == "operators/sum/kg-00064-00127.parquet"
    assert _job(partition=0, stage_tasks=4).key_groups(_meta(task_count=2)) == (0, 63)


def test_a_checkpoint_without_a_task_count_takes_the_stage_as_it_is() -> None:
    assert _job(partition=1, stage_tasks=4).key_groups(_meta(task_count=None)) == (32, 63)


def test_a_source_stage_task_has_no_key_groups() -> None:
    job = _job(partition=1, stage_tasks=None)
    assert job.key_groups(_meta(task_count=None)) is None
    assert job.file_name("dedup", None) == "operators/dedup/p00001.parquet"


def test_a_stage_of_more_tasks_than_key_groups_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="more than max_parallelism=16"):
        _job(partition=20, stage_tasks=32, max_parallelism=16).key_groups(_meta(task_count=32))
