"""A source topic deleted and created again under a job, on a real broker.

The new topic keeps the name and gets a new id; its offsets start at 0 again. The job's
checkpoint positions are offsets of the old topic, so going on from them skips the new
topic's first records, silently when the positions fall inside its log (found by the offsets
review: the first 100 records of the new topic were never processed, exit 0). Now every
checkpoint records the ids of the topics it read, a checkpoint commits only after the ids
were read again and are the same, and a restore refuses a checkpoint of another topic
(exit 78) unless ``--read-recreated-topics`` says to read the new topic from its start."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from examples.orders import create_topics, read_committed
from examples.workers import WorkerProcess, read_events, run_snapline
from integration_tests.conftest import create_topic

pytestmark = pytest.mark.integration
EX_CONFIG = 78


def _produce(bootstrap: str, topic: str, numbers: range, partition: int = 0) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for n in numbers:
        producer.produce(topic, orjson.dumps({"n": n}), partition=partition)
    assert producer.flush(30) == 0


def _recreate(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """Delete ``topic`` and create it again with ``partitions``: it gets a new id."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic], operation_timeout=30).values():
        future.result(timeout=35)
    deadline = time.monotonic() + 60  # bounded: the broker finishes a deletion in seconds
    while True:
        try:
            create_topic(admin, topic, partitions)
            return
        except Exception as exc:
            text = str(exc).lower()
            if time.monotonic() > deadline or not (
                "already exists" in text or "marked for deletion" in text
            ):
                raise
            time.sleep(0.5)


def _worker(spec: str, bootstrap: str, tmp_path: Path, prefix: str) -> WorkerProcess:
    return WorkerProcess(
        f"integration_tests.pipelines:{spec}",
        "w0",
        bootstrap,
        tmp_path / "chk",
        tmp_path,
        {"SNAPLINE_TEST_PREFIX": prefix},
    )


def _run_refused(worker: WorkerProcess, *args: str) -> str:
    """Run the worker once, expecting it to refuse to start (exit 78); its stderr."""
    result = worker.run_once(list(args))
    assert result.returncode == EX_CONFIG, (result.returncode, result.stderr[-3000:])
    return result.stderr


def test_a_topic_recreated_while_the_worker_was_frozen_commits_nothing_of_the_new_topic(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """The review's repro: the worker is frozen (SIGSTOP, shorter than the session timeout)
    while its source topic is deleted, created again and written with 300 records. Its
    consumer goes on at offset 100 of the new topic. Before: 200 of the 300 processed and
    committed, the first 100 never (exit 0). Now the checkpoint after the wake-up does not
    commit (the topic's id changed), the worker stops naming the topic, and a restart with
    ``--restore-latest --read-recreated-topics`` (the group's offsets went with the old topic)
    processes all 300 once, with the job's state."""
    prefix = f"{unique_name}-"
    source, out = f"{prefix}copy-in", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, out: 1})
    _produce(kafka_bootstrap, source, range(100))
    worker = _worker("named_copy", kafka_bootstrap, tmp_path, prefix)
    worker.start()
    try:
        first = read_committed(kafka_bootstrap, out, 100, timeout=60, settle=1)
        assert sorted(r["n"] for r in first) == list(range(100))
        time.sleep(1.0)  # the checkpoint of the last records has committed (interval 0.3 s)
        worker.signal(signal.SIGSTOP)
        _recreate(kafka_bootstrap, source)
        _produce(kafka_bootstrap, source, range(1000, 1300))
        worker.signal(signal.SIGCONT)
        # Bounded: its next checkpoint (0.3 s) fails at the id check, and the restore stops it.
        code = worker.wait_exit(90)
        assert code == EX_CONFIG, (code, worker.tail())
    finally:
        worker.signal(signal.SIGCONT)
        worker.kill()
    log = worker.tail(200)
    assert f"topics {source} were deleted and created again" in log, log
    assert "--restore-latest --read-recreated-topics" in log
    # Which check stopped it depends on the freeze: the id check before the commit, or (a
    # freeze past the session timeout) the restore after the rebalance. Either commits nothing.
    outputs = read_committed(kafka_bootstrap, out, 100, timeout=10, settle=1)
    assert sorted(r["n"] for r in outputs) == list(range(100)), "new records committed"

    worker.start(extra_args=["--restore-latest", "--read-recreated-topics"])
    try:
        outputs = read_committed(kafka_bootstrap, out, 400, timeout=60, settle=2)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in outputs) == [*range(100), *range(1000, 1300)]  # each once
    recreated = [
        e for e in read_events(worker.metrics_path) if e.get("event") == "source_topic_recreated"
    ]
    assert [(e["topic"], e["task"]) for e in recreated] == [(source, "p0")]


def test_a_latest_topic_created_again_with_more_partitions_is_read_from_its_start(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A source read from "latest" is deleted while the job is stopped and created again with
    a second partition; records go to both partitions. With ``--read-recreated-topics`` the
    job reads the new topic from its start: partition 0, which its checkpoint read (offsets
    of the old topic), and partition 1, which no checkpoint names. Before, partition 1 was
    taken for a partition the job had when it started and began at its end: its records were
    never read. All of the new topic came after the job started."""
    prefix = f"{unique_name}-"
    source, out = f"{prefix}copy-in", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, out: 1})
    _produce(kafka_bootstrap, source, range(-1, 0))  # before the job started: never read
    worker = _worker("latest_grow", kafka_bootstrap, tmp_path, prefix)
    worker.start()
    try:
        deadline = time.monotonic() + 60  # bounded: a first start restores in seconds
        while not any(e.get("event") == "restored" for e in read_events(worker.metrics_path)):
            assert time.monotonic() < deadline, worker.tail()
            time.sleep(0.1)
        _produce(kafka_bootstrap, source, range(5))
        first = read_committed(kafka_bootstrap, out, 5, timeout=60, settle=1)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in first) == list(range(5))

    # A static member back within the session timeout gets its old assignment without a
    # rebalance (KAFKA-13435), which would leave partition 1 unassigned: wait until the
    # group has let the stopped worker go (bounded: the session timeout is 10 s).
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    group = f"{prefix}job"
    deadline = time.monotonic() + 40
    while admin.describe_consumer_groups([group])[group].result(timeout=10).members:
        assert time.monotonic() < deadline, "the stopped worker is still a member"
        time.sleep(0.5)
    _recreate(kafka_bootstrap, source, partitions=2)
    _produce(kafka_bootstrap, source, range(10, 15))
    _produce(kafka_bootstrap, source, range(15, 20), partition=1)
    # The group's offsets went with the old topic: --restore-latest names the checkpoint.
    worker.start(extra_args=["--restore-latest", "--read-recreated-topics"])
    try:
        outputs = read_committed(kafka_bootstrap, out, 15, timeout=60, settle=2)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in outputs) == [*range(5), *range(10, 20)]  # each once
    log = worker.log_path.read_text(errors="replace")
    assert f"source topic {source} was created again since the job started" in log, log[-3000:]


def test_a_topic_recreated_while_the_job_was_stopped_is_refused_until_the_user_chooses(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """One task reads two topics; one of them is deleted and created again (with more records
    than the job had read of the old one) while the job is stopped. The other topic's
    committed offsets still name the checkpoint, whose position in the recreated topic (50)
    lies inside the new log: before, the restart skipped the new topic's first 50 records.
    Now it is refused (exit 78) naming the topic and the ways on; with
    ``--read-recreated-topics`` the new topic is read from its start and the other topic
    goes on where it was: every record once."""
    prefix = f"{unique_name}-"
    source, other, out = f"{prefix}copy-in", f"{prefix}copy-in2", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, other: 1, out: 1})
    _produce(kafka_bootstrap, source, range(50))
    _produce(kafka_bootstrap, other, range(500, 550))
    worker = _worker("two_topic_copy", kafka_bootstrap, tmp_path, prefix)
    worker.start()
    try:
        first = read_committed(kafka_bootstrap, out, 100, timeout=60, settle=1)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert sorted(r["n"] for r in first) == [*range(50), *range(500, 550)]

    _recreate(kafka_bootstrap, source)
    _produce(kafka_bootstrap, source, range(1000, 1200))
    _produce(kafka_bootstrap, other, range(550, 600))
    stderr = _run_refused(worker)
    assert f"source topics {source} (id " in stderr, stderr[-3000:]
    assert "--read-recreated-topics" in stderr and "under a new name" in stderr
    assert len(read_committed(kafka_bootstrap, out, 100, timeout=10, settle=1)) == 100

    worker.start(extra_args=["--read-recreated-topics"])
    try:
        outputs = read_committed(kafka_bootstrap, out, 350, timeout=60, settle=2)
    finally:
        assert worker.stop() == 0, worker.tail()
    expected = [*range(50), *range(500, 600), *range(1000, 1200)]
    assert sorted(r["n"] for r in outputs) == expected  # each once, none skipped


@pytest.mark.spark
def test_a_savepoint_of_a_recreated_topic_is_refused_until_the_user_chooses(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """A savepoint is taken (stop with savepoint); its source topic is then deleted and
    created again with more records than the job had read of the old one. Before, the restore
    committed the savepoint's offset (50) in the new topic: its first 50 records were skipped,
    silently. Now the savepoint records the topic's id and the restore refuses before changing
    Kafka (exit 78), and so does a Spark run from the savepoint; with
    ``--read-recreated-topics`` the services read the new topic from its start with the
    savepoint's state: the count per key goes on from 50, every record once."""
    prefix = f"{unique_name}-"
    source, out = f"{prefix}copy-in", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, out: 1})

    def produce(count: int) -> None:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for n in range(count):
            producer.produce(source, orjson.dumps({"n": n}), b"k", partition=0)
        assert producer.flush(30) == 0

    produce(50)
    worker = _worker("keyed_count", kafka_bootstrap, tmp_path, prefix)
    worker.start()
    try:
        first = read_committed(kafka_bootstrap, out, 50, timeout=60, settle=1)
    except BaseException:
        worker.kill()
        raise
    assert sorted(r["n"] for r in first) == list(range(1, 51))
    cli_env = {
        "SNAPLINE_TEST_PREFIX": prefix,
        "SNAPLINE_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SNAPLINE_CHECKPOINT_DIR": str(tmp_path / "chk"),
    }
    spec = "integration_tests.pipelines:keyed_count"
    created = run_snapline("savepoint", "create", spec, "--stop", cwd=tmp_path, env=cli_env)
    assert created.returncode == 0, created.stderr[-3000:]
    savepoint = created.stdout.strip().splitlines()[-1]
    assert worker.wait_exit(60) == 0, worker.tail()

    _recreate(kafka_bootstrap, source)
    produce(80)
    stderr = _run_refused(worker, "--from-savepoint", savepoint)
    assert f"source topics {source} (id " in stderr, stderr[-3000:]
    assert "since the savepoint" in stderr and "stopped before changing" in stderr
    assert not (tmp_path / "chk" / f"{prefix}job" / "restored-from-savepoint.json").exists()
    # A Spark run from the savepoint is refused too, before Spark starts.
    spark = run_snapline(
        "spark", "run", spec, "--from", f"savepoint:{savepoint}", cwd=tmp_path, env=cli_env
    )
    assert spark.returncode != 0
    assert f"source topics {source} were deleted and created again" in spark.stderr, spark.stderr

    worker.start(extra_args=["--from-savepoint", savepoint, "--read-recreated-topics"])
    try:
        outputs = read_committed(kafka_bootstrap, out, 130, timeout=90, settle=2)
    finally:
        assert worker.stop() == 0, worker.tail()
    # 1..50 before the savepoint; the new topic's 80 records counted on from its state
    assert sorted(r["n"] for r in outputs) == [*range(1, 51), *range(51, 131)]
    recreated = [
        e for e in read_events(worker.metrics_path) if e.get("event") == "source_topic_recreated"
    ]
    assert [(e["topic"], e["task"]) for e in recreated] == [(source, "p0")]
