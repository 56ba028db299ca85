"""A savepoint restore whose Kafka request fails (a broker restarting, a refused request)
stops with one line naming the job and what to do, as its other errors do, not with a
traceback of ``KafkaException``; the savepoint's URI in it carries no credentials. Pure
logic: the lock and the restore's steps are replaced; the steps on a real broker are in
integration_tests/test_savepoint_kafka.py."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from snapline.connectors import KafkaSource
from snapline.pipeline import Pipeline
from snapline.pipeline.errors import CheckpointError
from snapline.pipeline.savepoint import restore
from snapline.sinks import KafkaSink


class _Lock:
    released = False

    def __init__(self, *args: Any) -> None:
        pass

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        _Lock.released = True


def test_a_kafka_error_in_a_restore_is_one_line_naming_the_job(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    pipeline = Pipeline("orders")
    pipeline.source(KafkaSource("in")).key_by(lambda v: v, name="by-v").count().sink(
        KafkaSink("out")
    )

    def seed(*args: Any) -> int:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "broker 1: connection refused"))

    monkeypatch.setattr(restore, "RestoreLock", _Lock)
    monkeypatch.setattr(restore, "_seed", seed)
    with pytest.raises(CheckpointError) as caught:
        restore.seed_from_savepoint(
            pipeline,
            {"bootstrap.servers": "127.0.0.1:1"},
            str(tmp_path / "checkpoints"),
            "s3://key:secret@bucket/sp-1",
        )
    message = str(caught.value)
    assert "\n" not in message
    assert "job 'orders'" in message and "connection refused" in message
    assert "start it again" in message
    assert "secret" not in message
    assert _Lock.released
