"""A broken pipeline fails at declaration or start with a message that names the fix."""

from __future__ import annotations

import errno
import os

import pytest

from snapline.connectors import KafkaSource
from snapline.connectors.config import redact
from snapline.pipeline import (
    ConfigurationError,
    KeyedProcessFunction,
    MapState,
    Pipeline,
    StateError,
    ValueState,
)
from snapline.sinks import KafkaSink


class Counter(KeyedProcessFunction):
    n = ValueState("n", default=0)

    def process(self, value, ctx):
        self.n.update(self.n.value() + 1)
        yield self.n.value()


class StatefulMapper:
    seen = ValueState("seen", default=0)

    def __call__(self, value):
        return value


def good() -> Pipeline:
    p = Pipeline("job")
    p.source(KafkaSource("in")).key_by(lambda v: v["k"]).process(Counter()).sink(KafkaSink("out"))
    return p


def test_valid_pipeline() -> None:
    good().validate()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"checkpoint_interval": 0}, "checkpoint_interval"),
        ({"state_backend": "redis"}, "state_backend"),
        ({"guarantee": "maybe"}, "guarantee"),
        ({"max_parallelism": 0}, "max_parallelism"),
        ({"kafka_config": {"group.id": "x"}}, "manages"),
        ({"on_corrupt_checkpoint": "ignore"}, "on_corrupt_checkpoint"),
        # A TypeError traceback, or accepted, before (an audit's list):
        ({"checkpoint_timeout": "5"}, "checkpoint_timeout"),
        ({"checkpoint_timeout": None}, "checkpoint_timeout"),
        ({"checkpoint_interval": True}, "checkpoint_interval"),
        ({"kafka_config": "bootstrap.servers=x"}, "must be a dict"),
    ],
)
def test_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Pipeline("job", **kwargs)


def test_bad_name() -> None:
    with pytest.raises(ConfigurationError, match="letters, digits"):
        Pipeline("my job!")


def test_process_needs_key_by() -> None:
    p = Pipeline("job")
    with pytest.raises(ConfigurationError, match="key_by"):
        p.source(KafkaSource("in")).process(Counter())


def test_state_outside_keyed_function() -> None:
    p = Pipeline("job")
    with pytest.raises(ConfigurationError, match="KeyedProcessFunction"):
        p.source(KafkaSource("in")).map(StatefulMapper())


def test_state_used_unbound() -> None:
    with pytest.raises(StateError, match="not bound"):
        Counter().n.value()


class TwoTotals(KeyedProcessFunction):
    total = ValueState("total", default=0)
    seen = MapState("total")

    def process(self, value, ctx):
        yield value


class Timers(KeyedProcessFunction):
    timers = ValueState("__timers__")

    def process(self, value, ctx):
        yield value


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (TwoTotals(), "states seen, total of operator 'TwoTotals' are all named 'total'"),
        (Timers(), "a state of operator 'Timers' is named '__timers__', the name of its timers"),
    ],
    ids=["twice", "timers"],
)
def test_a_state_name_used_twice_in_an_operator_is_refused(
    function: KeyedProcessFunction, message: str
) -> None:
    """Restores find a state by (operator uid, name): of two states named alike one was
    kept, so every restart from a checkpoint failed as renumbered, and a savepoint merged
    both states' rows into one."""
    p = Pipeline("job")
    p.source(KafkaSource("in")).key_by(lambda v: v["k"]).process(function).sink(KafkaSink("o"))
    with pytest.raises(ConfigurationError, match="pass another name") as refused:
        p.validate()
    assert message in str(refused.value)


def test_no_sink_and_no_source() -> None:
    p = Pipeline("job")
    with pytest.raises(ConfigurationError, match="no source"):
        p.validate()
    p.source(KafkaSource("in")).map(lambda v: v)
    with pytest.raises(ConfigurationError, match="no sink"):
        p.validate()


def test_bad_source_options() -> None:
    with pytest.raises(ConfigurationError, match="format"):
        KafkaSource("in", value_format="avro")
    with pytest.raises(ConfigurationError, match="starting_position"):
        KafkaSource("in", starting_position="middle")


def test_topic_read_twice() -> None:
    p = Pipeline("job")
    a = p.source(KafkaSource("in"))
    b = p.source(KafkaSource("in"))
    a.union(b).sink(KafkaSink("out"))
    with pytest.raises(ConfigurationError, match="more than one source"):
        p.validate()


def test_secrets_are_redacted() -> None:
    cleaned = redact(
        {
            "sasl.password": "hunter2",
            "sasl.username": "me",
            "ssl.key.password": "x",
            "bootstrap.servers": "b:9092",
        }
    )
    assert cleaned["sasl.password"] == "***" and cleaned["ssl.key.password"] == "***"
    assert cleaned["sasl.username"] == "me" and cleaned["bootstrap.servers"] == "b:9092"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tolerable_failed_checkpoints": -1}, "tolerable_failed_checkpoints=-1"),
        ({"tolerable_failed_checkpoints": 1.5}, "must be an int >= 0"),
        ({"retained_checkpoints": 0}, "retained_checkpoints=0"),
    ],
)
def test_checkpoint_settings_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Pipeline("job", **kwargs)


def test_a_sink_key_that_is_not_a_function_fails_at_declaration() -> None:
    """KafkaSink(key="customer") was accepted; every output then went to the dead letters
    with "'str' object is not callable"."""
    with pytest.raises(ConfigurationError, match=r"key=lambda v: v\['customer'\]"):
        KafkaSink("out", key="customer")  # type: ignore[arg-type]


def test_a_private_class_gets_a_default_uid() -> None:
    """A process function named _Stamp was refused at start: its default uid '_Stamp' does
    not start with a letter or digit."""

    class _Stamp(KeyedProcessFunction):
        def process(self, value, ctx):
            yield value

    p = Pipeline("job")
    p.source(KafkaSource("in")).key_by(lambda v: v["k"]).process(_Stamp()).sink(KafkaSink("out"))
    assert list(p.operator_uids().values()) == ["Stamp"]


def test_kafka_settings_librdkafka_refuses_are_a_configuration_error() -> None:
    """acks=1 (idempotence needs all), enable.idempotence=False (transactions need it) or
    max.poll.interval.ms below session.timeout.ms made the worker exit 1 with a KafkaException
    traceback, which the supervisor restarted 5 times; now exit 78 with the fix."""
    from snapline.pipeline.runtime.transaction import TransactionalOutput

    for setting in ({"acks": 1}, {"enable.idempotence": False}):
        with pytest.raises(ConfigurationError, match="invalid Kafka settings for the producer"):
            TransactionalOutput(
                {"bootstrap.servers": "127.0.0.1:1", **setting}, transactional_id="t"
            )


def test_a_checkpoint_directory_that_is_a_file_is_a_configuration_error(tmp_path) -> None:
    from snapline.pipeline.checkpoint.storage import CheckpointStorage

    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(ConfigurationError, match="checkpoint directory .* cannot be used"):
        CheckpointStorage(str(afile / "checkpoints"))
    with pytest.raises(ConfigurationError, match="checkpoint directory .* cannot be used"):
        CheckpointStorage(str(afile))


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE, errno.ENOSPC])
def test_a_checkpoint_directory_failing_for_a_while_is_not_a_configuration_error(
    tmp_path, monkeypatch, code
) -> None:
    """An NFS server's I/O error or a full disk at start is no setting to fix: a
    CheckpointStorageError (the worker fails, its supervisor restarts it), not exit 78, which
    stops the job for good."""
    import pathlib

    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.errors import CheckpointStorageError

    def failing(path, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(pathlib.Path, "mkdir", failing)
    monkeypatch.setattr(os, "mkdir", failing)
    with pytest.raises(CheckpointStorageError, match="cannot be created now") as raised:
        CheckpointStorage(str(tmp_path / "checkpoints"))
    assert not isinstance(raised.value, ConfigurationError)


def test_a_parquet_table_that_is_a_file_is_a_configuration_error(tmp_path) -> None:
    from snapline.pipeline.sink import SinkContext
    from snapline.sinks import ParquetSink

    afile = tmp_path / "table"
    afile.write_text("x")
    context = SinkContext("job", "t-0", "w", "parquet", None, lambda *a: None)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="cannot be written .* is not a directory"):
        ParquetSink(str(afile)).open(context)


def test_a_parquet_table_failing_for_a_while_is_not_a_configuration_error(
    tmp_path, monkeypatch
) -> None:
    """As for the checkpoint directory: an I/O error creating the table is a SinkError (the
    worker is restarted), not exit 78."""
    from snapline.pipeline.errors import SinkError
    from snapline.pipeline.sink import SinkContext
    from snapline.sinks import ParquetSink, parquet

    def failing(path):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(parquet, "_makedirs_durable", failing)
    context = SinkContext("job", "t-0", "w", "parquet", None, lambda *a: None)  # type: ignore[arg-type]
    with pytest.raises(SinkError, match="cannot be created now") as raised:
        ParquetSink(str(tmp_path / "table")).open(context)
    assert not isinstance(raised.value, ConfigurationError)
