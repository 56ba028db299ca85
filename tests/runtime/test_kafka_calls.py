"""Bounded client calls and the classification of Kafka errors (no broker needed)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

import snapline
from snapline.pipeline.runtime.kafka_calls import (
    EX_TEMPFAIL,
    BoundedCall,
    ErrorClass,
    KafkaClientError,
    classify,
    delete_records,
    installed_client_version,
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


def test_a_call_made_inside_the_clients_callback_runs_on_the_calling_thread() -> None:
    """Inside a rebalance callback (``inline`` true) a helper thread would wait at the
    Consumer's one-thread gate (confluent-kafka 2.16+) for the call the callback is in."""
    inside = [True]
    call = BoundedCall("consumer", inline=lambda: inside[0])
    here = threading.get_ident()
    assert call("committed", 5, threading.get_ident) == here
    inside[0] = False
    assert call("committed", 5, threading.get_ident) != here


def test_an_inline_call_that_raises_raises_to_its_caller_and_leaves_the_client_usable() -> None:
    call = BoundedCall("consumer", inline=lambda: True)

    def fail() -> None:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT))

    with pytest.raises(KafkaException):
        call("committed", 5, fail)
    assert call.hung is None
    assert call("committed", 5, lambda: 7) == 7


def test_an_inline_call_that_returns_within_its_bound_leaves_no_timer_behind() -> None:
    call = BoundedCall("consumer", inline=lambda: True)
    call("committed", 0.2, lambda: None)
    time.sleep(0.4)  # past the bound: a timer left armed would have ended this process
    assert not [t for t in threading.enumerate() if t.name == "kafka-committed-bound"]


def test_an_inline_call_that_outlives_its_bound_ends_the_process_with_exit_75() -> None:
    """It cannot be left behind on a helper thread (it is on the caller's): the timer ends
    the process as a hung call ends the worker, and a restart recovers the checkpoint."""
    script = (
        "import threading\n"
        "from snapline.pipeline.runtime.kafka_calls import BoundedCall\n"
        "BoundedCall('consumer', inline=lambda: True)('committed', 1.0, threading.Event().wait)\n"
        "print('returned')\n"
    )
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == EX_TEMPFAIL, done.stderr
    assert "returned" not in done.stdout
    assert "consumer: committed did not return within 1s" in done.stderr
    assert time.monotonic() - started < 30


def test_the_version_checked_is_the_installed_release_not_its_first_character() -> None:
    """``confluent_kafka.version()`` is a str in these releases: its ``[0]`` is "2"."""
    assert installed_client_version() == importlib.metadata.version("confluent-kafka")
    assert installed_client_version().count(".") >= 2


def test_delete_records_leaves_the_list_of_partitions_it_was_given_alive() -> None:
    """confluent-kafka's ``delete_records`` (2.5 to 2.15.0; 2.12.2 is what the README
    installs) drops a reference to the list it is given that it never took: the list is
    freed while its owners hold it, and the heap is corrupt from there (workers, which
    delete consumed repartition records every checkpoint, died of SIGSEGV). Through the
    wrapper the list keeps every reference, whatever the release does (measured on the list
    the library is given: the wrapper passes it, not a copy). A real client; the
    request goes nowhere (no broker at that address), the call only has to return."""
    admin = AdminClient({"bootstrap.servers": "127.0.0.1:1", "log_level": 0})
    for _ in range(200):
        below = [TopicPartition("t", 0, 5), TopicPartition("t", 1, 7)]
        before = sys.getrefcount(below)
        futures = delete_records(admin, below, request_timeout=1)
        assert sys.getrefcount(below) == before
        assert sorted(futures, key=lambda tp: tp.partition) == below


def test_the_code_calls_admin_delete_records_only_through_the_wrapper() -> None:
    """A direct ``admin.delete_records(...)`` brings the reference bug back on the releases
    that have it (2.12.2 is what the README installs): in a worker, or in the pytest process
    of an integration test. ``tests/`` is left out: its fakes have the method."""
    repo = Path(snapline.__file__).parent.parent
    direct = [
        f"{path.relative_to(repo)}:{number}"
        for folder in ("snapline", "integration_tests", "examples", "benchmarks")
        for path in sorted((repo / folder).rglob("*.py"))
        if path.name != "kafka_calls.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ".delete_records(" in line
    ]
    assert direct == []
