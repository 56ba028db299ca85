"""Worker behaviour on a real broker: dead letters, at-least-once, SIGTERM, start errors."""

from __future__ import annotations

import random
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewPartitions

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.workers import WorkerProcess, fault_hits, process_state, read_events
from integration_tests.conftest import create_topic
from snapline.pipeline.runtime.kafka_calls import delete_records
from snapline.pipeline.runtime.topics import INTERNAL_TOPIC_CONFIG, without_event_time_config
from snapline.pipeline.supervisor import COMMITTED_FILE_ENV, IDLE_HEALTHY_ENV

pytestmark = pytest.mark.integration


def _committed(bootstrap: str, group: str, topic: str, partitions: int) -> list[TopicPartition]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        return consumer.committed([TopicPartition(topic, p) for p in range(partitions)], 10)
    finally:
        consumer.close()


def _wait_processed(bootstrap: str, topic: str, count: int, worker: WorkerProcess) -> None:
    """Until ``count`` outputs are in ``topic``, committed or not (read_uncommitted: a worker
    produces into its open transaction as it processes). Bounded: 60 s."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"uncommitted-{uuid.uuid4().hex[:8]}",
            "isolation.level": "read_uncommitted",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    seen = 0
    deadline = time.monotonic() + 60
    try:
        while seen < count:
            assert time.monotonic() < deadline, f"{seen} of {count} processed\n{worker.tail()}"
            seen += sum(1 for m in consumer.consume(1000, 0.5) if m.error() is None)
    finally:
        consumer.close()


def _start_worker(pipeline: str, bootstrap: str, tmp_path: Path, prefix: str) -> WorkerProcess:
    """A worker running ``integration_tests.pipelines:<pipeline>`` on topics ``<prefix>...``."""
    worker = WorkerProcess(
        f"integration_tests.pipelines:{pipeline}",
        "w0",
        bootstrap,
        tmp_path / "chk",
        tmp_path,
        {"SNAPLINE_TEST_PREFIX": prefix},
    )
    worker.start()
    return worker


def _dead_letters(bootstrap: str, topic: str, expected: int) -> list[Any]:
    """The committed messages of dead-letter ``topic`` (one partition): until ``expected``
    arrived, for at most 30 s."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "dlq-reader",
            "isolation.level": "read_committed",
        }
    )
    consumer.assign([TopicPartition(topic, 0, 0)])
    letters: list[Any] = []
    deadline = time.monotonic() + 30
    while len(letters) < expected and time.monotonic() < deadline:
        letters += [m for m in consumer.consume(100, 0.5) if m.error() is None]
    consumer.close()
    return letters


@pytest.mark.parametrize("pipeline", ["dead_letters", "dead_letters_rekeyed"])
def test_bad_records_go_to_dead_letter_topic(
    pipeline: str, kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Undecodable input and input the user's code raises on go to the dead letters with the
    input's own headers first. With a re-keying key_by the user's code runs in the keyed
    stage: those inputs crossed the repartition topic, and their headers with them."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}orders": 2, f"{prefix}totals": 2})
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": "murmur2_random"})
    good, bad = 0, []
    for i in range(300):
        customer = f"c{i % 7}"
        if i % 50 == 10:
            value = b"{not json"
        elif i % 50 == 20:
            value = orjson.dumps({"customer": customer, "amount": "ten", "order_id": i})
        else:
            value = orjson.dumps({"customer": customer, "amount": 1, "order_id": i})
            good += 1
        if i % 50 in (10, 20):
            bad.append(value)
        # The input's own headers (a trace id) go with its dead letter, before Snapline's.
        headers = [("trace-id", f"t{i}".encode()), ("empty", None)]
        producer.produce(f"{prefix}orders", value, customer.encode(), headers=headers)
    producer.flush(30)
    worker = _start_worker(pipeline, kafka_bootstrap, tmp_path, prefix)
    try:
        outputs = read_committed(kafka_bootstrap, f"{prefix}totals", good, timeout=60, settle=2)
        letters = _dead_letters(kafka_bootstrap, f"{prefix}job.dead-letter", len(bad))
    finally:
        worker.stop()
    assert len(outputs) == good and len({o["order_id"] for o in outputs}) == good
    assert sorted(m.value() for m in letters) == sorted(bad)
    traces = []
    for message in letters:
        listed = message.headers()
        assert [name for name, _ in listed[:2]] == ["trace-id", "empty"], listed
        assert listed[1][1] is None, listed
        headers = dict(listed)
        reason = headers["snapline.error"].decode()
        assert ("cannot decode" in reason) or ("amount must be an int" in reason)
        # Decoding fails in the source; the user's code runs after the repartition topic.
        where = "orders" if "cannot decode" in reason or pipeline == "dead_letters" else "job"
        assert headers["snapline.topic"].decode().startswith(f"{prefix}{where}"), listed
        assert int(headers["snapline.offset"]) >= 0
        order = int(headers["trace-id"].decode()[1:])  # the input's, with its own letter
        assert order % 50 == (10 if "cannot decode" in reason else 20), (reason, listed)
        traces.append(order)
    assert sorted(traces) == [i for i in range(300) if i % 50 in (10, 20)]


@pytest.mark.parametrize("limit", ["producer", "topic", "lowered"])
def test_an_output_too_large_for_the_producer_goes_to_the_dead_letters(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, limit: str
) -> None:
    """An output over the producer's message.max.bytes is bad output, like one the format
    cannot encode: its input goes to the dead letters, the worker goes on (before, the
    produce error ended it, and every restart ended on the same record).

    ``topic``: the output topic's max.message.bytes (64 KiB) is below the producer's
    default; the worker lowers the producer's limits to it at start (before, librdkafka took
    the record, the broker refused its batch and every commit of the epoch failed).
    ``lowered``: the topic's limit is lowered to 64 KiB while the worker runs; the first
    batch the broker refuses fails one checkpoint, the worker reads the limits again and
    goes on in the same process (before, every retry failed until the worker gave up and a
    restart read the new limit). One input is itself over the producer's limit: its dead
    letter names it and leaves its bytes out."""
    prefix = f"{unique_name}-"
    topic_limit = {"max.message.bytes": "65536"} if limit == "topic" else {}
    create_topics(
        kafka_bootstrap,
        {f"{prefix}orders": 2, f"{prefix}totals": 2},
        {f"{prefix}totals": topic_limit},
    )
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 1_040_000})
    padded = []
    huge = b""
    values = []
    for i in range(300):
        value = orjson.dumps({"customer": f"c{i % 7}", "amount": 1, "order_id": i})
        if i % 50 == 7:
            padded.append(value)
        if i == 120:  # over the worker's producer limit as an input already
            value = orjson.dumps(
                {"customer": f"c{i % 7}", "amount": 1, "order_id": i, "pad": "y" * 1_010_000}
            )
            huge = value
        values.append(value)
    # ``lowered``: the first 5 (none padded) go through before the limit changes.
    first = 5 if limit == "lowered" else 300
    for i, value in enumerate(values[:first]):
        producer.produce(f"{prefix}orders", value, f"c{i % 7}".encode(), headers=_trace(i))
    producer.flush(30)
    env = {"SNAPLINE_TEST_PREFIX": prefix}
    if limit != "producer":
        env["SNAPLINE_TEST_PAD"] = "100000"
    spec = "integration_tests.pipelines:oversized"
    worker = WorkerProcess(spec, "w0", kafka_bootstrap, tmp_path / "chk", tmp_path, env)
    worker.start()
    good = 300 - len(padded) - 1
    try:
        if limit == "lowered":
            read_committed(kafka_bootstrap, f"{prefix}totals", first, timeout=60, settle=0)
            _set_topic_config(kafka_bootstrap, f"{prefix}totals", "max.message.bytes", "65536")
            for i, value in enumerate(values[first:], first):
                producer.produce(f"{prefix}orders", value, f"c{i % 7}".encode(), headers=_trace(i))
            producer.flush(30)
        outputs = read_committed(kafka_bootstrap, f"{prefix}totals", good, timeout=60, settle=2)
        letters = _dead_letters(kafka_bootstrap, f"{prefix}job.dead-letter", len(padded) + 1)
        assert worker.alive, worker.tail()
    finally:
        worker.stop()
    ids = sorted(o["order_id"] for o in outputs)
    assert ids == [i for i in range(300) if i % 50 != 7 and i != 120], ids
    whole = [m for m in letters if m.value() is not None]
    assert sorted(m.value() for m in whole) == sorted(padded)
    for message in whole:
        reason = dict(message.headers())["snapline.error"].decode()
        assert "output too large for the producer" in reason and "message.max.bytes" in reason
    (omitted,) = [m for m in letters if m.value() is None]
    headers = dict(omitted.headers())
    assert headers["snapline.topic"] == f"{prefix}orders".encode()
    assert f"{len(huge)} bytes".encode() in headers["snapline.value-omitted"]
    assert headers["trace-id"] == b"t120"  # the input's own headers stay when its bytes go
    log = worker.log_path.read_text(errors="replace")
    assert "exit 75" not in log
    if limit == "topic":
        assert f"producer message.max.bytes={65536 - 256}" in log, log[-3000:]
    if limit == "lowered":
        assert "now accepts record batches of at most 65536 bytes" in log, log[-3000:]
        assert f"producer message.max.bytes={65536 - 256}" in log, log[-3000:]


def _trace(i: int) -> list[tuple[str, bytes]]:
    return [("trace-id", f"t{i}".encode())]


def _set_topic_config(bootstrap: str, topic: str, name: str, value: str) -> None:
    from confluent_kafka.admin import (
        AdminClient,
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
    )

    entry = ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource("topic", topic, incremental_configs=[entry])
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=30)


def test_at_least_once_loses_nothing_across_kills(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}orders": 2, f"{prefix}customer-totals": 2})
    env = {
        "SNAPLINE_EXAMPLE_PREFIX": prefix,
        "SNAPLINE_EXAMPLE_JOB": unique_name,
        "SNAPLINE_EXAMPLE_GUARANTEE": "at_least_once",
        "SNAPLINE_EXAMPLE_INTERVAL": "0.5",
    }
    worker = WorkerProcess(
        "examples.running_total:pipeline", "w0", kafka_bootstrap, tmp_path / "chk", tmp_path, env
    )
    worker.start()
    produced = 0
    for _ in range(4):
        produce_orders(kafka_bootstrap, f"{prefix}orders", 10_000, 100, start_id=produced)
        produced += 10_000
        time.sleep(1.5)
        worker.kill()
        worker.start()
    outputs = read_committed(
        kafka_bootstrap, f"{prefix}customer-totals", produced, timeout=120, settle=3
    )
    worker.stop()
    seen = {o["order_id"] for o in outputs}
    assert seen == set(range(produced)), f"lost {len(set(range(produced)) - seen)} orders"


def test_sigterm_takes_final_checkpoint_and_exits_cleanly(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}orders": 2, f"{prefix}customer-totals": 2})
    env = {
        "SNAPLINE_EXAMPLE_PREFIX": prefix,
        "SNAPLINE_EXAMPLE_JOB": unique_name,
        "SNAPLINE_EXAMPLE_INTERVAL": "30",
    }  # only the final checkpoint commits
    worker = WorkerProcess(
        "examples.running_total:pipeline", "w0", kafka_bootstrap, tmp_path / "chk", tmp_path, env
    )
    expected = produce_orders(kafka_bootstrap, f"{prefix}orders", 5000, 50)
    worker.start()
    # every order processed (its output in the open transaction), none committed yet
    _wait_processed(kafka_bootstrap, f"{prefix}customer-totals", 5000, worker)
    assert worker.stop(timeout=60) == 0, worker.tail()
    committed = _committed(kafka_bootstrap, unique_name, f"{prefix}orders", 2)
    assert sum(c.offset for c in committed) == 5000, committed
    outputs = read_committed(kafka_bootstrap, f"{prefix}customer-totals", 5000, timeout=30)
    assert verify_totals(outputs, expected, range(5000)).ok


@pytest.mark.parametrize("slow_storage", [False, True], ids=["storage", "slow-storage"])
def test_rebalance_commits_the_work_done_instead_of_redoing_it(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, slow_storage: bool
) -> None:
    """A second worker joins long before the first one's next periodic checkpoint: the first
    commits everything it read while its partitions are revoked, so the group's committed
    offsets cover all input at once and nothing is processed twice. (A restored worker's
    first checkpoint comes right after its first input, so the test feeds a first batch,
    waits for that checkpoint, and then the input the rebalance must commit.)

    With slow storage (3 s per write) that final checkpoint takes longer than the first
    worker's liveness timeout (5 s): its task thread waits for it in a loop that tells the
    watchdog it is alive, so the worker is not ended in the middle of it."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}orders": 4, f"{prefix}customer-totals": 4})
    env = {
        "SNAPLINE_EXAMPLE_PREFIX": prefix,
        "SNAPLINE_EXAMPLE_JOB": unique_name,
        "SNAPLINE_EXAMPLE_INTERVAL": "300",
    }  # no periodic checkpoint during the test
    a, b = (
        WorkerProcess(
            "examples.running_total:pipeline", w, kafka_bootstrap, tmp_path / "chk", tmp_path, env
        )
        for w in ("a", "b")
    )
    first = 200
    expected = produce_orders(kafka_bootstrap, f"{prefix}orders", first, 50)
    if slow_storage:
        a.start({"SNAPLINE_TEST_STORAGE_WRITE_DELAY": "3"}, ["--liveness-timeout", "5"])
    else:
        a.start()
    try:
        deadline = time.monotonic() + 60
        while not any(e.get("event") == "checkpoint" for e in read_events(a.metrics_path)):
            assert time.monotonic() < deadline, "no first checkpoint after the restore\n" + a.tail()
            time.sleep(0.3)
        assert _committed_sum(kafka_bootstrap, unique_name, prefix) == first
        more = produce_orders(kafka_bootstrap, f"{prefix}orders", 5000, 50, start_id=first)
        for customer, amount in more.items():
            expected[customer] = expected.get(customer, 0) + amount
        total = first + 5000
        # a reads and processes the 5000 orders; they are not committed yet
        _wait_processed(kafka_bootstrap, f"{prefix}customer-totals", total, a)
        assert _committed_sum(kafka_bootstrap, unique_name, prefix) == first
        b.start()  # the group rebalances: a's partitions are revoked
        deadline = time.monotonic() + 60
        committed = 0
        while committed < total and time.monotonic() < deadline:
            time.sleep(0.5)
            committed = _committed_sum(kafka_bootstrap, unique_name, prefix)
        assert committed == total, f"committed {committed} of {total} offsets\n{a.tail()}"
        assert a.alive, a.tail()
        events = read_events(a.metrics_path)
        revokes = [e for e in events if e["event"] == "revoke_checkpoint"]
        assert revokes and revokes[0]["committed"], events
        if slow_storage:  # longer than the liveness timeout, or the test proves nothing
            assert revokes[0]["seconds"] > 5, revokes
        outputs = read_committed(kafka_bootstrap, f"{prefix}customer-totals", total, timeout=30)
        assert verify_totals(outputs, expected, range(total)).ok
        # b restored a's checkpoint and found nothing left to do: no order was processed twice
        b_checkpoints = [e for e in events if e["event"] == "checkpoint" and e["worker"] == "b"]
        assert not b_checkpoints, b_checkpoints
    finally:
        for worker in (a, b):
            worker.stop()


def _committed_sum(bootstrap: str, group: str, prefix: str) -> int:
    return sum(max(c.offset, 0) for c in _committed(bootstrap, group, f"{prefix}orders", 4))


def _restores(worker: WorkerProcess) -> int:
    """How many restores the workers writing ``worker``'s metrics file have logged."""
    return sum(e.get("event") == "restored" for e in read_events(worker.metrics_path))


def _wait_restored(worker: WorkerProcess, times: int = 1) -> None:
    """Until the worker has restored its tasks (until ``times`` restores are logged in its
    metrics file: one more than before its latest start; 60 s at most: a restore takes
    seconds)."""
    deadline = time.monotonic() + 60
    while _restores(worker) < times:
        assert time.monotonic() < deadline, worker.tail()
        time.sleep(0.1)


def _add_partitions(bootstrap: str, topic: str, count: int) -> None:
    """Grow ``topic`` to ``count`` partitions; returns once the broker lists them all."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_partitions([NewPartitions(topic, count)]).values():
        future.result(timeout=30)
    deadline = time.monotonic() + 30  # bounded: the broker knows the partitions at once
    while len(admin.list_topics(topic, timeout=10).topics[topic].partitions) < count:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _run_expecting_failure(spec: str, bootstrap: str, prefix: str, tmp_path: Path) -> str:
    worker = WorkerProcess(
        spec, "w0", bootstrap, tmp_path / "chk", tmp_path, {"SNAPLINE_TEST_PREFIX": prefix}
    )
    result = worker.run_once()
    assert result.returncode != 0
    return result.stderr


def test_unknown_topic_fails_at_start_naming_the_fix(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    stderr = _run_expecting_failure(
        "integration_tests.pipelines:missing_topic", kafka_bootstrap, f"{unique_name}-", tmp_path
    )
    assert "do not exist" in stderr and "create_partitions" in stderr


def test_repartition_topic_with_other_partitions_fails_at_start_naming_the_fix(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    prefix = f"{unique_name}-"
    create_topics(
        kafka_bootstrap,
        {f"{prefix}orders": 2, f"{prefix}totals": 2, f"{prefix}job.key_by-1.repartition": 2},
    )
    stderr = _run_expecting_failure(
        "integration_tests.pipelines:repartition_mismatch", kafka_bootstrap, prefix, tmp_path
    )
    assert "has 2 partitions" in stderr and "partitions=4 is declared" in stderr


class _HandOver:
    """Workers a and b of the running-total example on 4 partitions, the orders fed to them
    and their expected totals; ``check`` asserts what a hand-over from b to a must show."""

    def __init__(self, bootstrap: str, tmp_path: Path, unique_name: str) -> None:
        self.bootstrap = bootstrap
        self.prefix = f"{unique_name}-"
        create_topics(bootstrap, {f"{self.prefix}orders": 4, f"{self.prefix}customer-totals": 4})
        env = {"SNAPLINE_EXAMPLE_PREFIX": self.prefix, "SNAPLINE_EXAMPLE_JOB": unique_name}
        self.a, self.b = (
            WorkerProcess(
                "examples.running_total:pipeline", w, bootstrap, tmp_path / "chk", tmp_path, env
            )
            for w in ("a", "b")
        )
        self.expected: dict[str, int] = {}
        self.produced = 0

    def feed(self, count: int) -> None:
        batch = produce_orders(
            self.bootstrap, f"{self.prefix}orders", count, 50, start_id=self.produced
        )
        for customer, amount in batch.items():
            self.expected[customer] = self.expected.get(customer, 0) + amount
        self.produced += count

    def read(self, timeout: float) -> list[Any]:
        return read_committed(
            self.bootstrap,
            f"{self.prefix}customer-totals",
            self.produced,
            timeout=timeout,
            settle=2,
        )

    def check(self, outputs: list[Any], seen_after: float, events: list[dict[str, Any]]) -> None:
        """Every order's effect exactly once, all of it seen within 45 s of b's kill, and a
        aborted b's transaction."""
        check = verify_totals(outputs, self.expected, range(self.produced))
        assert check.ok, f"{check} ({seen_after:.1f}s after the kill)\n{self.a.tail()}"
        assert seen_after < 45, f"every output seen only {seen_after:.1f}s after the kill"
        fenced = [e for e in events if e["event"] == "fenced_departed"]
        assert fenced and fenced[0]["departed"] == "b" and fenced[0]["worker"] == "a", events[-20:]


def test_a_dead_workers_open_transaction_is_aborted_by_the_worker_taking_its_tasks(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Worker b dies for good (SIGKILL, never restarted) while input flows, so its last
    transaction is open with outputs in it. That transaction would hide every later output of
    its partitions from read_committed readers until the broker aborts it, 60 s
    (transaction.timeout.ms) after it began. Worker a takes b's tasks once b's session times
    out (10 s), sees that b is no longer a member of the group and aborts b's transaction: every
    output is visible long before 60 s, exactly once."""
    job = _HandOver(kafka_bootstrap, tmp_path, unique_name)
    a, b = job.a, job.b
    a.start()
    b.start()
    try:
        deadline = time.monotonic() + 90  # both joined and each committed a checkpoint
        while {e["worker"] for e in read_events(a.metrics_path) if e["event"] == "checkpoint"} != {
            "a",
            "b",
        }:
            assert time.monotonic() < deadline, "no checkpoint of both workers\n" + b.tail()
            job.feed(20)
            time.sleep(0.2)
        for _ in range(10):  # input keeps flowing: b's open transaction holds outputs
            job.feed(50)
            time.sleep(0.05)
        b.kill()
        killed = time.monotonic()
        for _ in range(20):
            job.feed(50)
            time.sleep(0.1)
        # Without the abort nothing after b's open transaction is readable before ~60 s.
        outputs = job.read(timeout=40)
        seen_after = time.monotonic() - killed
        events = read_events(a.metrics_path)
    finally:
        a.stop()
        b.kill()
    job.check(outputs, seen_after, events)


def test_a_dead_workers_pending_offsets_are_aborted_before_its_transaction_times_out(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Worker b dies for good between sending its offsets to its transaction and committing
    it (SIGKILL at ``after_offsets_sent``). The broker keeps those offsets pending, and
    unreadable to worker a, which takes b's tasks once b's session times out (10 s), until
    b's transaction times out (71 s with the defaults). a looks for the writers of the
    tasks' newest checkpoints, finds b gone from the group and aborts its transaction: a
    restores and every order's effect is visible, exactly once, long before that."""
    job = _HandOver(kafka_bootstrap, tmp_path, unique_name)
    a, b = job.a, job.b
    a.start()
    try:
        deadline = time.monotonic() + 90  # a joined and committed a checkpoint
        while not any(e["event"] == "checkpoint" for e in read_events(a.metrics_path)):
            assert time.monotonic() < deadline, "no checkpoint of a\n" + a.tail()
            job.feed(20)
            time.sleep(0.2)
        b.start({"SNAPLINE_FAULT": "after_offsets_sent:1"})  # killed at its first commit
        deadline = time.monotonic() + 90  # b joins, gets tasks and commits (bounded)
        while b.alive:
            assert time.monotonic() < deadline, "b never reached its first commit\n" + b.tail()
            job.feed(20)
            time.sleep(0.2)
        killed = time.monotonic()
        assert fault_hits(b.fault_log).get("after_offsets_sent") == 1, b.tail()
        job.feed(200)
        # Without the abort a restores b's tasks only after b's transaction timed out.
        outputs = job.read(timeout=50)
        seen_after = time.monotonic() - killed
        events = read_events(a.metrics_path)
    finally:
        a.stop()
        b.kill()
    job.check(outputs, seen_after, events)


def test_a_supervised_worker_with_nothing_to_commit_reports_its_run_healthy_once_quiet(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A worker with no input commits nothing; told by its supervisor (the environment) to
    report after 3 s of quiet, it creates the supervisor's file without any checkpoint, 3 s
    plus the time its restore took after it started, not before (a restore is not quiet
    time)."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}orders": 2, f"{prefix}customer-totals": 2})
    healthy = tmp_path / "w0.committed"
    worker = WorkerProcess(
        "examples.running_total:pipeline",
        "w0",
        kafka_bootstrap,
        tmp_path / "chk",
        tmp_path,
        {
            "SNAPLINE_EXAMPLE_PREFIX": prefix,
            "SNAPLINE_EXAMPLE_JOB": unique_name,
            COMMITTED_FILE_ENV: str(healthy),
            IDLE_HEALTHY_ENV: "3",
        },
    )
    before = time.time()
    worker.start()
    try:
        deadline = time.monotonic() + 60  # bounded: start, join, restore, 3 s of quiet
        while not healthy.exists():
            assert time.monotonic() < deadline, "never reported healthy\n" + worker.tail()
            assert worker.alive, worker.tail()
            time.sleep(0.2)
        reported = healthy.stat().st_mtime
        events = read_events(worker.metrics_path)
    finally:
        worker.stop()
    restores = [e["seconds"] for e in events if e["event"] == "restored"]
    assert restores, events
    assert reported >= before + 3 + sum(restores) - 0.05, (reported, before, restores)
    assert not [e for e in events if e["event"] == "checkpoint"], events


@pytest.mark.parametrize("repartition", ["created", "existing"])
def test_every_event_time_crosses_a_repartition_topic_unchanged(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str, repartition: str
) -> None:
    """A Kafka producer reads timestamp 0 as "now": an event time of 0 (a missing field's
    default) reached the keyed stage as the wall clock, and its windows and timers with it.
    Event times <= 0 now travel one lower and are restored on reading. An event time two days
    ahead (Kafka 4 refuses timestamps over an hour ahead by default) failed every checkpoint
    until the worker gave up; repartition topics now accept any timestamp, whether the worker
    creates them or finds them created by an earlier version ("existing"). An existing one
    also gets its retention set to keep everything (records between stages are deleted by
    the job once read; a retention set by hand deleted them before: found by review)."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}times-in": 1, f"{prefix}times-out": 1})
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    repartition_topic = f"{prefix}times.key_by-1.repartition"
    if repartition == "existing":
        legacy = without_event_time_config(INTERNAL_TOPIC_CONFIG)
        legacy.update({"retention.ms": "3600000", "retention.bytes": "100000000"})
        create_topic(admin, repartition_topic, 1, legacy)
    ahead = int(time.time() * 1000) + 2 * 86_400_000
    sent = [0, -1, -5, 1, 5, 1_700_000_000_000, ahead]
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for i, t in enumerate(sent):
        producer.produce(f"{prefix}times-in", orjson.dumps({"k": f"k{i}", "t": t}))
    producer.flush(30)
    worker = _start_worker("event_times", kafka_bootstrap, tmp_path, prefix)
    try:
        outputs = read_committed(kafka_bootstrap, f"{prefix}times-out", len(sent), timeout=60)
    finally:
        worker.stop()
    assert sorted((o["sent"], o["seen"]) for o in outputs) == sorted((t, t) for t in sent)
    (described,) = admin.describe_configs([ConfigResource("topic", repartition_topic)]).values()
    config = described.result(timeout=30)
    assert (config["retention.ms"].value, config["retention.bytes"].value) == ("-1", "-1")


def test_a_window_result_too_large_for_kafka_is_a_dead_letter_with_its_start(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A window's result larger than the output topic takes was dead-lettered with no value
    (a window result has no input record to send instead, and its state is gone once it
    fired), its reason saying the dead letter held the input record. Now the dead letter holds
    the result's first bytes (its key and window) and says so; the other windows go on."""
    prefix = f"{unique_name}-"
    create_topics(
        kafka_bootstrap,
        {f"{prefix}big-in": 1, f"{prefix}big-out": 1},
        {f"{prefix}big-out": {"max.message.bytes": "65536"}},
    )
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    rng = random.Random(3)
    # Key "big": three 30 KB pads of random hex (lz4 does not shrink it) in window [0, 1000).
    events = [{"k": "big", "t": 100 * i, "pad": rng.randbytes(15_000).hex()} for i in range(3)]
    events += [{"k": f"small{i}", "t": 100 * i, "pad": "x"} for i in range(3)]
    events += [{"k": "end", "t": 5_000, "pad": ""}]  # the watermark passes the first window
    for event in events:
        producer.produce(f"{prefix}big-in", orjson.dumps(event))
    producer.flush(30)
    worker = _start_worker("big_windows", kafka_bootstrap, tmp_path, prefix)
    try:
        outputs = read_committed(kafka_bootstrap, f"{prefix}big-out", 3, timeout=60)
        (letter,) = _dead_letters(kafka_bootstrap, f"{prefix}big.dead-letter", 1)
        assert worker.alive, worker.tail()
    finally:
        worker.stop()
    assert sorted(o["key"] for o in outputs) == ["small0", "small1", "small2"]
    assert letter.value() is not None
    assert letter.value().startswith(b'{"key":"big","start":0,"end":1000,"value":"')
    reason = dict(letter.headers())["snapline.error"].decode()
    assert "the dead letter holds its first" in reason and "holds the input record" not in reason


def test_a_state_whose_ttl_was_added_since_the_checkpoint_is_refused_at_start(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A value of a state with a TTL is stored behind its expiry: restarted from its own
    checkpoints after a TTL was added in the code, a job read every count as expired in 1970
    (the counts started over, silently). Now the worker stops at start (exit 78), naming the
    state and the fix."""
    prefix = f"{unique_name}-"
    create_topics(kafka_bootstrap, {f"{prefix}ttl-in": 1, f"{prefix}ttl-out": 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for _ in range(3):
        producer.produce(f"{prefix}ttl-in", orjson.dumps({"k": "a"}))
    producer.flush(30)
    worker = _start_worker("ttl_counts", kafka_bootstrap, tmp_path, prefix)
    try:
        outputs = read_committed(kafka_bootstrap, f"{prefix}ttl-out", 3, timeout=60, settle=0)
        assert max(o["n"] for o in outputs) == 3
    finally:
        assert worker.stop() == 0
    worker.start({"SNAPLINE_TEST_TTL": "3600"})
    assert worker.wait_exit(60) == 78, worker.tail()
    log = worker.log_path.read_text(errors="replace")
    assert "state 'n' of operator 'count' has no TTL in checkpoint" in log, worker.tail()
    assert "but ttl=3600000 ms in the code" in log


def _two_jobs(
    bootstrap: str,
    tmp_path: Path,
    prefix: str,
    spec: str,
    first: tuple[str, dict[str, str]],
    second: tuple[str, dict[str, str]],
) -> tuple[WorkerProcess, WorkerProcess]:
    """A worker of each of two jobs of ``spec`` (``integration_tests.pipelines``), both
    reading ``<prefix>copy-in`` and writing ``<prefix>copy-out`` (created here): (worker id,
    extra environment) each; ``SNAPLINE_TEST_JOB`` in it names a job other than the default."""
    create_topics(bootstrap, {f"{prefix}copy-in": 1, f"{prefix}copy-out": 1})
    first_worker, second_worker = (
        WorkerProcess(
            spec,
            worker_id,
            bootstrap,
            tmp_path / f"chk-{which}",
            tmp_path,
            {"SNAPLINE_TEST_PREFIX": prefix, **env},
        )
        for which, (worker_id, env) in (("first", first), ("second", second))
    )
    return first_worker, second_worker


def test_a_worker_whose_transactional_id_a_running_worker_of_another_job_has_is_refused(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Job ``<p>job`` with worker ``x-1`` and job ``<p>job-x`` with worker ``1`` both get the
    transactional id ``snapline-<p>job-x-1``: each start of one fenced the other's producer,
    for as long as both ran. The one started second now stops at start (exit 78) naming the
    other, and the first runs on unfenced."""
    prefix = f"{unique_name}-"
    first, second = _two_jobs(
        kafka_bootstrap,
        tmp_path,
        prefix,
        "integration_tests.pipelines:named_copy",
        ("x-1", {}),
        ("1", {"SNAPLINE_TEST_JOB": f"{prefix}job-x"}),
    )
    first.start()
    try:
        # The first worker's output shows it joined its group and committed a transaction.
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        producer.produce(f"{prefix}copy-in", orjson.dumps({"n": 1}))
        producer.flush(30)
        assert read_committed(kafka_bootstrap, f"{prefix}copy-out", 1, timeout=60, settle=0)
        second.start()
        assert second.wait_exit(60) == 78, second.tail()
        log = second.log_path.read_text(errors="replace")
        assert f"transactional id 'snapline-{prefix}job-x-1'" in log, second.tail()
        assert f"worker 'x-1' of job '{prefix}job'" in log, second.tail()
        # The first was not fenced: its next transaction commits, its process runs on.
        producer.produce(f"{prefix}copy-in", orjson.dumps({"n": 2}))
        producer.flush(30)
        outputs = read_committed(kafka_bootstrap, f"{prefix}copy-out", 2, timeout=60, settle=0)
        assert sorted(o["n"] for o in outputs) == [1, 2]
        assert first.proc is not None and first.proc.poll() is None, first.tail()
        assert "fenced" not in first.log_path.read_text(errors="replace").lower(), first.tail()
    finally:
        second.kill()
        assert first.stop() == 0, first.tail()


def test_a_job_whose_repartition_topic_another_job_reads_is_refused(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Job ``<p>job`` with ``key_by(name="eu.by-n")`` and job ``<p>job.eu`` with
    ``key_by(name="by-n")`` both have the repartition topic ``<p>job.eu.by-n.repartition``:
    each deleted the records below its own positions there, the other's unread ones included,
    and read the other's records. The second one started is refused at start (exit 78)
    naming the first, whose group has offsets in the topic; the first runs on."""
    prefix = f"{unique_name}-"
    first, second = _two_jobs(
        kafka_bootstrap,
        tmp_path,
        prefix,
        "integration_tests.pipelines:named_rekey",
        ("w0", {"SNAPLINE_TEST_KEY_BY": "eu.by-n"}),
        ("w1", {"SNAPLINE_TEST_JOB": f"{prefix}job.eu"}),
    )
    first.start()
    try:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        producer.produce(f"{prefix}copy-in", orjson.dumps({"n": 1}))
        producer.flush(30)
        # Its output shows the keyed stage read the repartition topic and committed.
        assert read_committed(kafka_bootstrap, f"{prefix}copy-out", 1, timeout=60, settle=0)
        second.start()
        assert second.wait_exit(60) == 78, second.tail()
        log = second.log_path.read_text(errors="replace")
        topic = f"{prefix}job.eu.by-n.repartition"
        assert f"repartition topic '{topic}'" in log and f"job '{prefix}job'" in log, log[-3000:]
        producer.produce(f"{prefix}copy-in", orjson.dumps({"n": 2}))
        producer.flush(30)
        outputs = read_committed(kafka_bootstrap, f"{prefix}copy-out", 2, timeout=60, settle=1)
        assert sorted(o["n"] for o in outputs) == [1, 2]
    finally:
        second.kill()
        assert first.stop() == 0, first.tail()


def test_two_jobs_started_together_with_one_transactional_id_end_with_one_running(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """The check at start sees only workers that are group members already: two colliding
    workers started in the same instant both pass it. Here the first is frozen right after its
    check (SIGSTOP at ``after_namesake_check``) while the second starts, joins and commits;
    then the first wakes and its ``init_transactions`` fences the second. The first fencing
    now ends one of the two (exit 78, naming the other) and the other runs on; before, each
    fenced the other in turn for as long as both ran."""
    prefix = f"{unique_name}-"
    first, second = _two_jobs(
        kafka_bootstrap,
        tmp_path,
        prefix,
        "integration_tests.pipelines:named_copy",
        ("x-1", {"SNAPLINE_FAULT": "after_namesake_check:1:stop"}),
        ("1", {"SNAPLINE_TEST_JOB": f"{prefix}job-x"}),
    )
    first.start()
    try:
        assert first.proc is not None
        deadline = time.monotonic() + 60  # start-up and the check: seconds
        while process_state(first.proc.pid) != "T":
            assert first.alive and time.monotonic() < deadline, first.tail()
            time.sleep(0.1)
        second.start()
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        producer.produce(f"{prefix}copy-in", orjson.dumps({"n": 1}))
        producer.flush(30)
        assert read_committed(kafka_bootstrap, f"{prefix}copy-out", 1, timeout=60, settle=0)
        first.signal(signal.SIGCONT)
        # A fencing comes with the woken worker's init_transactions or its next transaction;
        # the check after it takes one describe call. Bound: two checkpoint intervals, a
        # failure's back-off, start-up and group join, with room.
        deadline = time.monotonic() + 120
        while first.alive and second.alive:
            assert time.monotonic() < deadline, (
                "both workers still run, fencing each other\n"
                + first.tail()
                + "\n----\n"
                + second.tail()
            )
            time.sleep(0.5)
        ended, survivor = (first, second) if not first.alive else (second, first)
        assert ended.wait_exit(5) == 78, ended.tail()
        log = ended.log_path.read_text(errors="replace")
        assert "which worker" in log and "fence each other's transactions" in log, ended.tail()
        # The survivor runs on unfenced: the next input is copied exactly once.
        before = read_committed(kafka_bootstrap, f"{prefix}copy-out", 1, timeout=30, settle=3)
        producer.produce(f"{prefix}copy-in", orjson.dumps({"n": 2}))
        producer.flush(30)
        after = read_committed(
            kafka_bootstrap, f"{prefix}copy-out", len(before) + 1, timeout=60, settle=3
        )
        assert [o["n"] for o in after].count(2) == 1, (after, survivor.tail())
        assert survivor.alive, survivor.tail()
    finally:
        first.signal(signal.SIGCONT)
        first.kill()
        second.kill()


def test_source_records_deleted_before_the_job_read_them_stop_it_until_the_user_chooses(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Found by review: retention deleted records the stopped job had not read; the restarted
    worker's consumer jumped to the log's start (auto.offset.reset) and went on, exit 0, with
    only librdkafka's "offset reset" line on stderr: 50 of 200 inputs never processed. Now the
    worker stops (exit 78) naming the partition and how many records are gone, and goes on
    from the log's start only with --skip-deleted-records."""
    prefix = f"{unique_name}-"
    source, out = f"{prefix}copy-in", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, out: 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(numbers: range) -> None:
        for n in numbers:
            producer.produce(source, orjson.dumps({"n": n}), partition=0)
        producer.flush(30)

    produce(range(100))
    worker = _start_worker("named_copy", kafka_bootstrap, tmp_path, prefix)
    first = read_committed(kafka_bootstrap, out, 100, timeout=60, settle=1)
    assert worker.stop() == 0
    assert sorted(r["n"] for r in first) == list(range(100))

    produce(range(100, 200))  # then retention deletes 100..149 before the job reads them
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for future in delete_records(admin, [TopicPartition(source, 0, 150)]).values():
        future.result(timeout=35)
    stderr = _run_expecting_failure(
        "integration_tests.pipelines:named_copy", kafka_bootstrap, prefix, tmp_path
    )
    assert f"source topic {source}[0] starts at offset 150, but the job's checkpoint " in stderr
    assert "continues at 100: 50 records were deleted" in stderr, stderr[-3000:]
    assert "--skip-deleted-records" in stderr
    assert len(read_committed(kafka_bootstrap, out, 100, timeout=10, settle=1)) == 100

    worker.start(extra_args=["--skip-deleted-records"])
    outputs = read_committed(kafka_bootstrap, out, 150, timeout=60, settle=2)
    assert worker.stop() == 0
    assert sorted(r["n"] for r in outputs) == [*range(100), *range(150, 200)]  # each once
    events = read_events(worker.metrics_path)
    skipped = [e for e in events if e.get("event") == "source_records_deleted"]
    assert [(e["from"], e["to"], e["records"]) for e in skipped] == [(100, 150, 50)]


def test_a_latest_source_starts_before_a_transaction_still_open_at_its_end(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A source starting at "latest" took the partition's high watermark as its position: a
    producer's transaction still open there had written records below it. The consumer
    itself started at the last stable offset, but a checkpoint taken before the partition
    brought a record (the task's other topic did) committed the high watermark, and after a
    restart the transaction's records, committed meanwhile, were skipped. Records 0..4 sit
    in an open transaction on copy-in when the job starts; copy-in2's records make it
    checkpoint; the job stops; the transaction commits; 5..9 come; the job starts again. It
    must output all of 0..9 and copy-in2's records, each once."""
    prefix = f"{unique_name}-"
    source, other, out = f"{prefix}copy-in", f"{prefix}copy-in2", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, other: 1, out: 1})
    plain = Producer({"bootstrap.servers": kafka_bootstrap})
    plain.produce(source, orjson.dumps({"n": -1}), partition=0)  # before the start: skipped
    assert plain.flush(30) == 0
    open_txn = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"{prefix}t"})
    open_txn.init_transactions(30)
    open_txn.begin_transaction()
    for n in range(5):
        open_txn.produce(source, orjson.dumps({"n": n}), partition=0)
    assert open_txn.flush(30) == 0  # written, not committed: the high watermark is past them
    worker = _start_worker("latest_copy", kafka_bootstrap, tmp_path, prefix)
    try:
        _wait_restored(worker)
        for n in range(100, 105):
            plain.produce(other, orjson.dumps({"n": n}), partition=0)
        assert plain.flush(30) == 0
        first = read_committed(kafka_bootstrap, out, 5, timeout=60, settle=1)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in first) == list(range(100, 105))
    open_txn.commit_transaction(30)
    for n in range(5, 10):
        plain.produce(source, orjson.dumps({"n": n}), partition=0)
    assert plain.flush(30) == 0
    worker.start()
    try:
        outputs = read_committed(kafka_bootstrap, out, 15, timeout=60, settle=1)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in outputs) == [*range(10), *range(100, 105)]


def test_a_latest_source_killed_before_its_first_checkpoint_reads_what_came_after_its_start(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A source starting at "latest" resolved the partition's end again at every start until
    its first checkpoint committed: a worker killed before that (here in the commit of the
    first checkpoint of records 0..4, which Kafka never made visible) was restarted at the
    end as it was then, and records 0..4, written after the job had started, were never
    output. Now the task commits where it started before it reads (no checkpoint named), and
    its next owner starts there: all of 0..9, each once, and not -1 (before the start)."""
    prefix = f"{unique_name}-"
    source, out = f"{prefix}copy-in", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, f"{prefix}copy-in2": 1, out: 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(numbers: range) -> None:
        for n in numbers:
            producer.produce(source, orjson.dumps({"n": n}), partition=0)
        assert producer.flush(30) == 0

    produce(range(-1, 0))  # before the start: skipped
    worker = WorkerProcess(
        "integration_tests.pipelines:latest_copy",
        "w0",
        kafka_bootstrap,
        tmp_path / "chk",
        tmp_path,
        {"SNAPLINE_TEST_PREFIX": prefix, "SNAPLINE_FAULT": "after_offsets_sent:1"},
    )
    worker.start()  # killed in its first commit
    _wait_restored(worker)
    produce(range(5))
    assert worker.wait_exit(60) == -9, worker.tail()  # bounded: it checkpoints every 0.3 s
    del worker.env["SNAPLINE_FAULT"]
    produce(range(5, 7))  # while no worker runs
    seen = _restores(worker)
    worker.start()
    try:
        _wait_restored(worker, times=seen + 1)
        produce(range(7, 10))
        outputs = read_committed(kafka_bootstrap, out, 10, timeout=60, settle=1)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in outputs) == list(range(10))


def test_a_latest_topic_the_code_reads_since_is_read_from_its_start_after_an_early_kill(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """The same for a "latest" topic added to the code of a job with checkpoints: its
    partitions have no committed offset until the first checkpoint after the change commits,
    and a worker killed before that was restarted at their end as it was then (found by
    review). The job reads copy-in (0..4 copied), then its code reads copy-in2 too; the
    worker is killed in the commit of 100..104 from copy-in2; restarted, it must output them
    and 105..107, each once, and nothing of copy-in twice."""
    prefix = f"{unique_name}-"
    source, added, out = f"{prefix}copy-in", f"{prefix}copy-in2", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, added: 1, out: 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(topic: str, numbers: range) -> None:
        for n in numbers:
            producer.produce(topic, orjson.dumps({"n": n}), partition=0)
        assert producer.flush(30) == 0

    produce(added, range(-1, 0))  # before its reader started: skipped
    before = _start_worker("latest_grow", kafka_bootstrap, tmp_path, prefix)  # copy-in only
    try:
        _wait_restored(before)
        produce(source, range(5))
        assert len(read_committed(kafka_bootstrap, out, 5, timeout=60, settle=0.5)) == 5
    finally:
        assert before.stop() == 0, before.tail()
    # Its static membership ends with its session (10 s): the new code's worker joins a group
    # that assigns anew (restarted sooner, it would get its old assignment back: KAFKA-13435).
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    group = f"{prefix}job"
    deadline = time.monotonic() + 60
    while admin.describe_consumer_groups([group])[group].result(timeout=15).members:
        assert time.monotonic() < deadline, "the stopped worker's session did not end"
        time.sleep(0.5)
    worker = WorkerProcess(
        "integration_tests.pipelines:latest_copy",  # copy-in and copy-in2
        "w0",
        kafka_bootstrap,
        tmp_path / "chk",
        tmp_path,
        {"SNAPLINE_TEST_PREFIX": prefix, "SNAPLINE_FAULT": "after_offsets_sent:1"},
    )
    seen = _restores(worker)  # the metrics file is the first worker's too
    worker.start()  # killed in its first commit
    _wait_restored(worker, times=seen + 1)
    produce(added, range(100, 105))
    assert worker.wait_exit(60) == -9, worker.tail()  # bounded: it checkpoints every 0.3 s
    del worker.env["SNAPLINE_FAULT"]
    seen = _restores(worker)
    worker.start()
    try:
        _wait_restored(worker, times=seen + 1)
        produce(added, range(105, 108))
        outputs = read_committed(kafka_bootstrap, out, 13, timeout=60, settle=1)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in outputs) == [*range(5), *range(100, 108)]


def test_a_partition_added_to_a_latest_source_while_the_job_runs_is_read_from_its_start(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A source reading from "latest" started a partition added while the job ran at its end
    when the consumer first saw it: what producers wrote there until then (up to the metadata
    refresh interval, 5 minutes by default) was never read. Flink reads a partition it
    discovers from its start, and so does Snapline now: "latest" is the end when the job
    started (the partition counts then are recorded in the checkpoint directory). Records
    5..9 go to partition 1 right after it is added: the job must output 0..9 (and not -1,
    written before it started), each once."""
    prefix = f"{unique_name}-"
    source, out = f"{prefix}copy-in", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, out: 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(numbers: range, partition: int) -> None:
        for n in numbers:
            producer.produce(source, orjson.dumps({"n": n}), partition=partition)
        assert producer.flush(30) == 0

    produce(range(-1, 0), 0)  # before the start: skipped
    worker = _start_worker("latest_grow", kafka_bootstrap, tmp_path, prefix)
    try:
        _wait_restored(worker)
        produce(range(5), 0)
        assert len(read_committed(kafka_bootstrap, out, 5, timeout=60, settle=0.5)) == 5
        _add_partitions(kafka_bootstrap, source, 2)
        producer = Producer({"bootstrap.servers": kafka_bootstrap})  # knows partition 1
        produce(range(5, 10), 1)
        outputs = read_committed(kafka_bootstrap, out, 10, timeout=60, settle=1)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in outputs) == list(range(10))
    added = [
        e for e in read_events(worker.metrics_path) if e.get("event") == "source_partition_added"
    ]
    assert [(e["topic"], e["partition"]) for e in added] == [(source, 1)]


def test_partitions_added_while_the_workers_restart_are_assigned_and_read(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Both workers are stopped and started again within the session timeout (a deploy)
    while the source grows from 2 to 4 partitions. Each rejoins as the same static member and
    gets its old assignment back, without a rebalance (KAFKA-13435), so partitions 2 and 3
    belonged to nobody: their records were never read, with both workers running. Now a
    worker that finds partitions no member holds after its assignment joins the group again,
    and the leader's rejoin rebalances it: every record is read, once."""
    prefix = f"{unique_name}-"
    source, out = f"{prefix}copy-in", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 2, out: 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(numbers: range, partitions: int) -> None:
        for n in numbers:
            producer.produce(source, orjson.dumps({"n": n}), partition=n % partitions)
        assert producer.flush(30) == 0

    workers = [
        WorkerProcess(
            "integration_tests.pipelines:named_copy",
            worker_id,
            kafka_bootstrap,
            tmp_path / "chk",
            tmp_path,
            {"SNAPLINE_TEST_PREFIX": prefix},
        )
        for worker_id in ("w0", "w1")
    ]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            _wait_restored(worker)
        produce(range(10), 2)
        assert len(read_committed(kafka_bootstrap, out, 10, timeout=60, settle=0.5)) == 10
        for worker in workers:
            assert worker.stop() == 0, worker.tail()
        _add_partitions(kafka_bootstrap, source, 4)
        for worker in workers:  # well within the 10 s session timeout: the same members
            worker.start()
        producer = Producer({"bootstrap.servers": kafka_bootstrap})  # knows partitions 2, 3
        produce(range(10, 30), 4)
        # Bounded: the check runs 5 s after w0's first checkpoint under its assignment, and
        # the rebalance and restore take seconds.
        outputs = read_committed(kafka_bootstrap, out, 30, timeout=90, settle=2)
    finally:
        for worker in workers:
            assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in outputs) == list(range(30))  # each once
    rejoins = [
        e
        for worker in workers
        for e in read_events(worker.metrics_path)
        if e.get("event") == "rejoined_for_unassigned"
    ]
    assert rejoins and all(e["partitions"] == 2 for e in rejoins), rejoins


def test_a_partition_added_to_a_source_holds_the_keyed_stages_watermark_back(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """The keyed stage's watermark is the minimum over the source stage's tasks, one per
    source partition, counted when the worker started. A partition added while the job ran
    got a task whose watermarks the keyed stage ignored (until every worker restarted): the
    other partitions' watermark fired window [0, 1000) without a's record 300 of the new
    partition, which then came late (a dead letter). Now the counts are read again at every
    restore (the group rebalances when the consumer sees the new partition), and the window
    waits for the new partition's task: it fires once, with all three of a's records."""
    prefix = f"{unique_name}-"
    source, out = f"{prefix}win-in", f"{prefix}win-out"
    create_topics(kafka_bootstrap, {source: 1, out: 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(partition: int, *events: tuple[str, int]) -> None:
        for key, t in events:
            producer.produce(source, orjson.dumps({"k": key, "t": t}), partition=partition)
        assert producer.flush(30) == 0

    produce(0, ("a", 100), ("a", 200))
    worker = _start_worker("window_counts_grow", kafka_bootstrap, tmp_path, prefix)
    try:
        _wait_restored(worker)
        _add_partitions(kafka_bootstrap, source, 2)
        # Bounded: the consumer sees the partition within its 1 s metadata refresh, and the
        # rebalance and restore take seconds.
        deadline = time.monotonic() + 60
        while not any(
            "p1" in e.get("checkpoints", {})
            for e in read_events(worker.metrics_path)
            if e.get("event") == "restored"
        ):
            assert time.monotonic() < deadline, worker.tail()
            time.sleep(0.2)
        produce(0, ("z", 5000))
        # Ten checkpoint intervals (0.3 s) for partition 0's watermark to reach the keyed
        # stage: before the fix, window [0, 1000) fired here without record 300.
        time.sleep(3)
        producer = Producer({"bootstrap.servers": kafka_bootstrap})  # knows partition 1
        produce(1, ("a", 300), ("z", 6000))
        outputs = read_committed(kafka_bootstrap, out, 1, timeout=60, settle=3)
    finally:
        assert worker.stop() == 0, worker.tail()
    fired = [(o["key"], o["start"], o["value"]) for o in outputs]
    assert fired == [("a", 0, 3)], fired


def test_a_source_topic_grown_alone_splits_no_task_over_two_workers(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Two workers copy the records of two unioned topics: task p reads partition p of both.
    One topic grows from 2 to 3 partitions while the job runs; the range assignor then gave
    partition 1 of one topic to one worker and of the other to the other worker, and both
    ran task p1 (with keyed state, each with half its input and the whole state: wrong
    output), each worker's retention deleting the other's checkpoints. Now every worker
    exits (75) before it restores anything, naming the fix; once the other topic has grown
    too, they start again and every record is copied once."""
    prefix = f"{unique_name}-"
    first, second, out = f"{prefix}copy-in", f"{prefix}copy-in2", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {first: 2, second: 2, out: 2})
    produced: list[tuple[int, int]] = []

    def produce(count: int) -> None:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})  # knows every partition
        for _ in range(count):
            n = len(produced)
            for source, topic in ((1, first), (2, second)):
                producer.produce(topic, orjson.dumps({"n": n, "src": source}), f"k{n}".encode())
                produced.append((source, n))
        assert producer.flush(30) == 0

    workers = [
        WorkerProcess(
            "integration_tests.pipelines:union_copy_grow",
            worker_id,
            kafka_bootstrap,
            tmp_path / "chk",
            tmp_path,
            {"SNAPLINE_TEST_PREFIX": prefix},
        )
        for worker_id in ("w0", "w1")
    ]
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})

    def members() -> int:
        future = admin.describe_consumer_groups([f"{prefix}job"], request_timeout=10)
        return len(future[f"{prefix}job"].result(timeout=15).members)

    try:
        for worker in workers:
            worker.start()
        produce(20)
        assert len(read_committed(kafka_bootstrap, out, 40, timeout=90, settle=0.5)) == 40
        _add_partitions(kafka_bootstrap, first, 3)
        for worker in workers:
            # bounded: the consumers look for new partitions every second, then rebalance
            assert worker.wait_exit(60) == 75, worker.tail()
            assert "have different numbers of partitions" in worker.tail(100), worker.tail()
        _add_partitions(kafka_bootstrap, second, 3)
        # A static member back within its session (10 s) would get its old assignment, made
        # with the old counts (its worker exits 75 again; a supervisor's backoff outlasts
        # the session): started once the group has let them go.
        deadline = time.monotonic() + 60
        while members():
            assert time.monotonic() < deadline, "the group kept its stopped members"
            time.sleep(0.5)
        for worker in workers:
            worker.start()
        produce(30)
        outputs = read_committed(kafka_bootstrap, out, len(produced), timeout=90, settle=2)
    finally:
        for worker in workers:
            if worker.alive:
                assert worker.stop() == 0, worker.tail()
    assert sorted((r["src"], r["n"]) for r in outputs) == sorted(produced)  # each once
