"""A worker's deletion of consumed repartition records (``Worker._delete_in_same_topic``, the
callback of its topic id check): sent only in the topic it started with, and only while the
answer that says so is fresh. Pure logic: the callback runs on an answered future, with an
admin client that records what it was asked (the broker's side is in
integration_tests/test_recovery_deletes_only_dead.py)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from snapline.pipeline.runtime import worker as worker_module
from snapline.pipeline.runtime.faults import FaultInjector
from snapline.pipeline.runtime.worker import REPARTITION_ID_CHECK_BOUND, Worker

TOPIC = "job.by-customer.repartition"
OLD_ID, NEW_ID = "b1d3Xg2oQmKcP1xyZ0aaaa", "Qk7sLw9eR5uT3vYx1bbbbb"


class _Admin:
    def __init__(self) -> None:
        self.deleted: list[list[TopicPartition]] = []

    def delete_records(self, below: list[TopicPartition], **_: Any) -> dict[Any, Future]:
        self.deleted.append(below)
        return {}


def _check(answer_id: str, asked: float, known: str = OLD_ID) -> _Admin:
    admin = _Admin()
    worker = SimpleNamespace(
        _repartition_topic_ids={TOPIC: known},
        faults=FaultInjector(""),
        _background_admin=lambda: admin,
    )
    done = Worker._delete_in_same_topic(worker, TOPIC, [TopicPartition(TOPIC, 0, 870)], asked)  # type: ignore[arg-type]
    answer: Future = Future()
    answer.set_result(SimpleNamespace(topic_id=answer_id))
    done(answer)
    return admin


def test_a_fresh_answer_for_the_same_topic_deletes() -> None:
    assert _check(OLD_ID, time.monotonic()).deleted == [[TopicPartition(TOPIC, 0, 870)]]


def test_a_topic_created_again_is_not_deleted_in() -> None:
    assert _check(NEW_ID, time.monotonic()).deleted == []


def test_an_answer_older_than_the_bound_deletes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """A process frozen between its check and its deletion (SIGSTOP, a paused VM) past its
    session timeout: the job may have been restored meanwhile."""
    asked = time.monotonic() - REPARTITION_ID_CHECK_BOUND - 1
    with caplog.at_level("WARNING", logger=worker_module.log.name):
        assert _check(OLD_ID, asked).deleted == []
    assert "its id was checked" in caplog.text
