"""Bounded client calls and the classification of Kafka errors (no broker needed)."""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import KafkaError, KafkaException

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.runtime.kafka_calls import (
    EX_TEMPFAIL,
    BoundedCall,
    ErrorClass,
    KafkaClientError,
    check_client_library,
    classify,
    is_unavailable,
)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (KafkaError(KafkaError._TRANSPORT), ErrorClass.RETRIABLE),
        (KafkaError(KafkaError._ALL_BROKERS_DOWN), ErrorClass.RETRIABLE),
        (KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS), ErrorClass.RETRIABLE),
        (KafkaError(KafkaError._TIMED_OUT, retriable=True), ErrorClass.RETRIABLE),
        (KafkaError(KafkaError._TIMED_OUT, txn_requires_abort=True), ErrorClass.ABORTABLE),
        (KafkaError(KafkaError.INVALID_PRODUCER_EPOCH), ErrorClass.ABORTABLE),
        (KafkaError(KafkaError._FENCED, fatal=True), ErrorClass.FATAL),
        (KafkaError(KafkaError.PRODUCER_FENCED), ErrorClass.FATAL),
        # the consumer's error event for a fatal error: code _FATAL, fatal() may be False
        (
            KafkaError(KafkaError._FATAL, "Static consumer fenced by other consumer"),
            ErrorClass.FATAL,
        ),
        (KafkaError(KafkaError.FENCED_INSTANCE_ID), ErrorClass.FATAL),
    ],
)
def test_classify(error: KafkaError, expected: ErrorClass) -> None:
    assert classify(error) is expected


def test_abortable_timeout_is_still_an_outage() -> None:
    # send_offsets_to_transaction's timeout is abortable, but it means "broker unreachable"
    assert is_unavailable(KafkaError(KafkaError._TIMED_OUT, txn_requires_abort=True))
    assert not is_unavailable(KafkaError(KafkaError.INVALID_PRODUCER_EPOCH))


def test_bounded_call_returns_and_raises() -> None:
    call = BoundedCall("producer")
    assert call("add", 5, lambda a, b: a + b, 2, 3) == 5

    def fail() -> None:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    with pytest.raises(KafkaException):
        call("fail", 5, fail)
    assert call.hung is None


def test_a_hung_call_gives_up_after_its_bound_and_poisons_the_client() -> None:
    call = BoundedCall("producer")
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(KafkaClientError, match="did not return within") as info:
        call("send_offsets_to_transaction", 0.3, release.wait)
    assert time.monotonic() - started < 2
    assert info.value.exit_code == EX_TEMPFAIL
    with pytest.raises(KafkaClientError, match="stuck in send_offsets_to_transaction"):
        call("commit_transaction", 5, lambda: None)
    release.set()


@pytest.mark.parametrize("version", ["2.16.0", "2.16.1", "2.17.0rc1", "3.0.0"])
def test_a_confluent_kafka_whose_consumer_admits_one_thread_is_refused_with_the_fix(
    version: str,
) -> None:
    """From 2.16 a Consumer lets one thread at a time into its calls: the worker's bounded
    calls in its rebalance callback would wait for consume() forever (the first assignment
    hangs until the bound exits the worker, every restart again)."""
    with pytest.raises(ConfigurationError, match=r"confluent-kafka>=2.12,<2.16"):
        check_client_library(version)


@pytest.mark.parametrize("version", ["2.12.0", "2.12.2", "2.15.1"])
def test_a_confluent_kafka_before_the_consumer_gate_is_accepted(version: str) -> None:
    check_client_library(version)


def test_the_tests_run_on_a_supported_confluent_kafka() -> None:
    check_client_library()
