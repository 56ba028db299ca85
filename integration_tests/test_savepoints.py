"""Savepoints on real workers and a real broker (issue 11): stop-with-savepoint and restarts
with 3× and ⅓ of the keyed stage's partitions under SIGKILLs; a savepoint of a running job
followed by a crash of everything and a restart from the savepoint; a corrupt savepoint file;
state read back by pyarrow (and Spark in test_savepoint_state_with_spark). Independent readers
check every sink: a read_committed consumer, pyarrow on the Parquet table, SQL.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from examples.orders import read_committed, verify_totals
from examples.workers import read_events
from integration_tests.warehouse_job import (
    SPEC,
    WarehouseJob,
    cli_env,
    kill_randomly,
    snapline,
    start_from_savepoint,
    wait_for,
    wait_frozen,
    wait_running,
)

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.slow]


def saved_totals(path: str, uid: str = "RunningTotal") -> dict[str, int]:
    """Per-customer running totals in a savepoint, read with pyarrow alone."""
    table = ds.dataset(f"{path}/operators/{uid}", format="parquet").to_table()
    rows = [r for r in table.to_pylist() if r["state"] == "total"]
    keys = Counter(r["key_text"] for r in rows)
    assert all(n == 1 for n in keys.values()), "a key appears in two files of the savepoint"
    return {r["key_text"]: int(r["value_json"]) for r in rows}


def test_stop_with_savepoint_and_rescale_up_and_down_under_kills(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """4 → 12 → 4 partitions of the keyed stage through stop-with-savepoint, ≥ 10 SIGKILLs
    after each restart; every sink exactly once; the saved per-customer state is exact. The
    way down replaces the repartition topic by its next generation's."""
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=4,
        interval=0.3,
        keyed_by_order=True,
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2", "SNAPLINE_EXAMPLE_PARTITIONS": "4"},
    )
    jobs.append(job)
    rng = random.Random(17)
    for worker in job.workers:
        worker.start()
    job.produce(20_000)
    wait_running(job)
    job.produce(10_000)  # some of it still in flight in the repartition topic at the savepoint
    first = snapline(job, "savepoint", "create", SPEC, "--stop")
    for worker in job.workers:
        assert worker.wait_exit(60) == 0, worker.tail()
    assert Path(first, "_savepoint.json").exists()
    inspect = snapline(job, "savepoint", "inspect", first)
    assert inspect  # printed a table

    for partitions, savepoint in ((12, first), (4, None)):
        if savepoint is None:
            job.verify()  # every order processed: the saved state must be the final one
            savepoint = snapline(job, "savepoint", "create", SPEC, "--stop")
            for worker in job.workers:
                assert worker.wait_exit(60) == 0, worker.tail()
            assert saved_totals(savepoint) == job.expected, "savepoint state per key"
        start_from_savepoint(job, savepoint, partitions)
        kill_randomly(job, 10, rng, 20_000)
        # 4 -> 12 gains partitions in the topic; 12 -> 4 replaces it by a topic of a new
        # name (Kafka cannot remove partitions, and no name is used again) and deletes it.
        first_name = f"{job.name}.by-customer.repartition"
        topic = first_name if partitions == 12 else f"{job.name}.by-customer.g1.repartition"
        consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "check"})
        try:
            topics = consumer.list_topics(timeout=10).topics
            assert len(topics[topic].partitions) == partitions, sorted(topics)
            if topic != first_name:
                assert first_name not in topics, "the replaced topic was not deleted"
        finally:
            consumer.close()
    job.verify()
    final = snapline(job, "savepoint", "create", SPEC, "--stop")
    assert saved_totals(final) == job.expected


def test_savepoint_of_a_running_job_then_crash_and_restart_from_it(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """A savepoint taken under load, the job keeps running, every worker is SIGKILLed, and the
    job restarts from the savepoint: each order's effect is exactly once in the output the
    job committed before the savepoint plus the output of the restarted job, in every sink."""
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=4,
        interval=0.3,
        keyed_by_order=True,
        # The running total is slow until the restart, so the savepoint surely finds records
        # in flight in the repartition topic: their replay is part of what is checked.
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2", "SNAPLINE_EXAMPLE_VARIANT": "slow"},
    )
    jobs.append(job)
    for worker in job.workers:
        worker.start()
    job.produce(20_000)
    wait_running(job)
    job.produce(20_000)  # stage 1 runs ahead of the slow running total
    path = snapline(job, "savepoint", "create", SPEC)
    job.produce(10_000)  # processed after the savepoint, undone and redone by the restore
    time.sleep(3)
    for worker in job.workers:
        worker.kill()
    ends = _end_offsets(kafka_bootstrap, job.totals_topic)
    seeded_from = _max_checkpoint_id(job)
    for worker in job.workers:
        worker.env["SNAPLINE_EXAMPLE_VARIANT"] = ""  # the restarted job at full speed
    start_from_savepoint(job, path, 4)
    job.produce(10_000)
    meta = orjson.loads(Path(path, "_savepoint.json").read_bytes())["body"]
    # Orders whose outputs the job had committed when the savepoint was taken: read by the
    # source stage before it (below its source offsets) and by the running total too. Orders
    # in flight in the repartition topic at the savepoint were output by the old job only
    # after it, and are output again by the restarted job (the savepoint replays them).
    flight = _in_flight_orders(path)
    before = _orders_before(kafka_bootstrap, job.orders_topic, meta["source_offsets"])
    assert flight, "no record in flight at the savepoint: their replay went unchecked"
    assert flight <= before, "a record in flight at the savepoint is not below its offsets"
    before -= flight
    assert 0 < len(before) < 40_000

    def outputs() -> list[dict[str, Any]]:
        return _read_split(kafka_bootstrap, job.totals_topic, ends, before)

    wait_for("the restarted job's outputs", lambda: len(outputs()) >= job.produced, 180, job.logs)
    result = verify_totals(outputs(), job.expected, range(job.produced))
    assert result.ok, "Kafka: " + result.summary()
    rows = [
        r
        for r in job.table_rows_with_checkpoint()
        if r["checkpoint"] > seeded_from or r["order_id"] in before
    ]
    restarted = [r for r in rows if r["checkpoint"] > seeded_from]
    assert restarted, "the restarted job wrote no rows"
    table = verify_totals(rows, job.expected, range(job.produced))
    assert table.ok, "Parquet: " + table.summary()
    assert job.database() == {
        c: (t, Counter(r["customer"] for r in rows)[c]) for c, t in job.expected.items()
    }, "PostgreSQL"
    job.stop_all()


def test_a_restore_publishes_what_a_committed_checkpoint_staged_and_no_worker_published(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """The worker dies between Kafka's commit and the sinks' publish (SIGKILL at
    ``after_kafka_commit``) and the job is left stopped; then ``savepoint from-checkpoint``
    and ``run --from-savepoint`` (as for a rescale). The seeded checkpoint lists no staged
    output, so its recovery discarded that checkpoint's Parquet files and PostgreSQL rows as
    never committed, while Kafka held their orders' outputs. The restore now publishes them
    first, as the worker's restart would have."""
    job = WarehouseJob(
        kafka_bootstrap, unique_name, tmp_path, postgres_dsn, partitions=2, workers=1
    )
    jobs.append(job)
    job.produce(3_000)
    worker = job.workers[0]
    worker.start(extra_env={"SNAPLINE_FAULT": "after_kafka_commit:1"})
    assert worker.proc is not None
    assert worker.proc.wait(120) == -9, worker.tail()  # start-up and one checkpoint
    committed = read_committed(kafka_bootstrap, job.totals_topic, 1, timeout=30, settle=2)
    assert committed, "the killed checkpoint committed nothing to Kafka"
    files = [f.relative_to(job.table) for f in job.table.rglob("*.parquet")]
    published = [f for f in files if not f.parts[0].startswith("_")]
    staged = [f for f in files if f.parts[0] == "_staging"]
    assert staged and not published, f"nothing left unpublished to check: {published}"
    path = snapline(job, "savepoint", "from-checkpoint", SPEC)
    start_from_savepoint(job, path, 2)
    job.produce(1_000)
    job.verify()  # every order once in Kafka, Parquet and PostgreSQL
    job.stop_all()


def test_a_savepoint_restores_into_code_with_one_more_stage(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """The new code re-keys once more before the running total (2 stages -> 3): the task
    reading by-customer was s1-p*, it is s2-p* now. The restore reads the old job's committed
    checkpoints by the old layout (to publish what their sinks staged), not the new one's."""
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=2,
        workers=1,
        keyed_by_order=True,
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2"},
    )
    jobs.append(job)
    job.workers[0].start()
    job.produce(4_000)
    job.wait_until_caught_up()
    path = snapline(job, "savepoint", "create", SPEC, "--stop")
    assert job.workers[0].wait_exit(60) == 0, job.workers[0].tail()
    job.workers[0].env["SNAPLINE_EXAMPLE_STAGES"] = "3"
    start_from_savepoint(job, path, 2)
    job.produce(2_000)
    job.verify()
    job.stop_all()


def test_a_savepoint_restored_into_another_checkpoint_storage_goes_on_above_its_ids(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """A job moved to another checkpoint storage with a savepoint (docs/savepoints.md). The
    restore numbered checkpoints from 1 again there, and the PostgreSQL sink's upsert keeps a
    row its task wrote at a higher id: every update of an existing customer was dropped,
    silently, until the new ids passed the old ones. The savepoint now records the highest id
    the job used, and the restore's ids go on above it."""
    job = WarehouseJob(
        kafka_bootstrap, unique_name, tmp_path, postgres_dsn, partitions=2, workers=1
    )
    jobs.append(job)
    job.workers[0].start()
    job.produce(2_000)
    job.wait_until_caught_up()
    path = snapline(job, "savepoint", "create", SPEC, "--stop")
    assert job.workers[0].wait_exit(60) == 0, job.workers[0].tail()
    old_highest = _max_checkpoint_id(job)
    assert old_highest >= 1, old_highest
    job.checkpoint_dir = tmp_path / "moved-checkpoints"
    for worker in job.workers:
        worker.checkpoint_dir = job.checkpoint_dir
    start_from_savepoint(job, path, 2)
    job.produce(2_000)
    job.verify()  # the PostgreSQL totals of customers updated after the move included
    new_ids = [
        int(chk.name.split("-")[1])
        for task in (job.checkpoint_dir / job.name / "tasks").iterdir()
        for chk in task.iterdir()
        if chk.name.startswith("chk-")
    ]
    assert new_ids and min(new_ids) > old_highest, (sorted(new_ids), old_highest)
    job.stop_all()


def _stopped_with_records_in_flight(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> tuple[WarehouseJob, str]:
    """A 2-worker, 2-stage job stopped with a savepoint (--stop) that has records in flight in
    its repartition topic; the job and the savepoint's path."""
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=2,
        interval=0.3,
        keyed_by_order=True,
        # A slow running total, so the savepoint surely finds records in flight.
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2", "SNAPLINE_EXAMPLE_VARIANT": "slow"},
    )
    jobs.append(job)
    for worker in job.workers:
        worker.start()
    job.produce(10_000)
    wait_running(job)
    job.produce(10_000)
    path = snapline(job, "savepoint", "create", SPEC, "--stop")
    for worker in job.workers:
        assert worker.wait_exit(60) == 0, worker.tail()
    assert _in_flight_orders(path), "no record in flight at the savepoint: nothing to check"
    for worker in job.workers:
        worker.env["SNAPLINE_EXAMPLE_VARIANT"] = ""
    return job, path


def test_workers_started_from_one_savepoint_at_once_restore_it_once(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """Both workers start with the same --from-savepoint at the same moment (a deployment's
    replicas). Each recreated the repartition topics and wrote the records in flight back:
    twice, or one's copy deleted after the other's checkpoints named it. Now one restores
    while the other waits for it, then continues from the job's checkpoints. The overlap is
    forced: the first restore is frozen (SIGSTOP) while the second starts."""
    job, path = _stopped_with_records_in_flight(
        kafka_bootstrap, postgres_dsn, tmp_path, unique_name, jobs
    )
    first, second = job.workers
    # The first restore freezes after its checks, before it changes Kafka; the second starts.
    first.start(
        {"SNAPLINE_FAULT": "restore_before_kafka_changes:1:stop"}, ["--from-savepoint", path]
    )
    wait_frozen(first, "the first restore frozen before changing Kafka", 120, job.logs)
    second.start(extra_args=["--from-savepoint", path])
    # Less than the lock's session (10 s), so the first keeps it: the second must wait. (It
    # restored the job meanwhile before, and the first then did it again.)
    deadline = time.monotonic() + 7
    while time.monotonic() < deadline and "restored job " not in second.log_path.read_text():
        time.sleep(0.2)
    first.signal(signal.SIGCONT)
    job.produce(2_000)
    job.verify()  # every order once in Kafka, Parquet and PostgreSQL
    restores = sum(w.log_path.read_text().count("restored job ") for w in job.workers)
    assert restores == 1, job.logs()
    # The savepoint deleted once the job runs (found by the audit of destructive actions: a
    # worker still started with --from-savepoint then failed at every start, "not a complete
    # savepoint", before it looked whether the job was restored from it already).
    snapline(job, "savepoint", "delete", path)
    assert not Path(path).exists()
    second.kill()
    second.start(extra_args=["--from-savepoint", path])
    job.produce(1_000)
    job.verify()
    assert "the savepoint is gone since" in second.log_path.read_text(), second.tail()
    restores = sum(w.log_path.read_text().count("restored job ") for w in job.workers)
    assert restores == 1, job.logs()
    job.stop_all()


def test_a_worker_whose_start_a_restore_overtook_restarts_before_it_processes(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """Found by review: a worker reads the job's repartition topics and partition counts at
    start, after it waited for a running restore and before it joins the group. A restore
    that ran entirely in between (the group was empty) left it the old job's plan: with a
    replaced topic, its tasks wrote to a topic nobody reads any more. Now its first
    assignment finds the restore's marker changed and it exits 75; restarted, it runs with the
    job as restored. Forced: the worker is frozen at start (after its plan) while the other
    worker restores the job; every sink is verified."""
    job, path = _stopped_with_records_in_flight(
        kafka_bootstrap, postgres_dsn, tmp_path, unique_name, jobs
    )
    late, restorer = job.workers
    late.start({"SNAPLINE_FAULT": "after_namesake_check:1:stop"})
    wait_frozen(late, "the worker frozen after reading its plan", 120, job.logs)
    restorer.start(extra_args=["--from-savepoint", path])
    wait_for(
        "the restore complete",
        lambda: "restored job " in restorer.log_path.read_text(),
        180,
        job.logs,
    )
    late.signal(signal.SIGCONT)
    assert late.wait_exit(120) == 75, late.tail()  # its first assignment: join, then exit
    assert "completed after this worker read the job's topics" in late.tail(), late.tail()
    late.start()
    job.produce(2_000)
    job.verify()  # every order once in Kafka, Parquet and PostgreSQL


@pytest.mark.parametrize(
    "stall",
    [
        "restore_before_topics",
        "restore_before_marker",
        "restore_before_delete",
        "restore_before_commit",
    ],
)
def test_a_restore_that_stalls_past_its_lock_changes_nothing_once_another_finished(
    stall: str,
    kafka_bootstrap: str,
    postgres_dsn: str,
    tmp_path: Path,
    unique_name: str,
    jobs: list[Any],
) -> None:
    """Found by review: the restore lock is a lease. A restore frozen after its marker and
    before it recreated the repartition topics, for longer than the lock's session (10 s),
    lost the lock without knowing; the other worker's restore took it and finished, and the
    job ran on. The first, woken, deleted and recreated the repartition topics under the
    running job and wrote the savepoint's records in flight back a second time. It must stop
    without changing anything more: every order once in Kafka, Parquet and PostgreSQL. One
    frozen right before it wrote its marker must not leave the marker behind either: every
    later start of a worker would be refused until the savepoint was restored again. One
    frozen after its guard's last check, before it commits the records in flight it wrote
    back and the job's offsets, must commit neither when it wakes (the second restore's
    producer fenced it), not even while the job is stopped and its group empty: the records
    were written back by the second already, and its offsets would rewind the job to the
    savepoint (both were plain writes: a restore frozen before them wrote them anyway)."""
    job, path = _stopped_with_records_in_flight(
        kafka_bootstrap, postgres_dsn, tmp_path, unique_name, jobs
    )
    first, second = job.workers
    first.start({"SNAPLINE_FAULT": f"{stall}:1:stop"}, ["--from-savepoint", path])
    wait_frozen(first, f"the first restore frozen at {stall}", 120, job.logs)

    def restores_of_second() -> int:
        events = read_events(second.metrics_path)
        return sum(e.get("event") == "restored" and e["worker"] == second.worker_id for e in events)

    before = restores_of_second()
    woken_deletes = stall == "restore_before_delete"
    if woken_deletes:
        # The running job's total slow again, so that its repartition topic holds records in
        # flight when the first wakes and sends its DeleteRecords (which took them all when it
        # deleted "to the end" of whenever it arrived).
        second.env["SNAPLINE_EXAMPLE_VARIANT"] = "slow"
    second.start(extra_args=["--from-savepoint", path])
    # The lock's session (10 s) expires; the second restores the job and runs it.
    wait_for(
        "the second restoring the job and running it",
        lambda: "restored job " in second.log_path.read_text() and restores_of_second() > before,
        120,
        job.logs,
    )
    job.produce(10_000 if woken_deletes else 2_000)
    if woken_deletes:
        topic = f"{job.name}.by-customer.repartition"
        # Ends: stage 1 writes the 10,000 orders within seconds, the slow total takes ~5 s.
        wait_for(
            "records in flight in the repartition topic",
            lambda: _in_flight(kafka_bootstrap, topic, job.name) >= 1_000,
            60,
            job.logs,
        )
    woken_commits = stall == "restore_before_commit"
    if woken_commits:
        # Woken while the job is stopped, its offsets would be accepted (no member in the
        # group), the job rewound to the savepoint: every output since, twice.
        job.wait_until_caught_up()
        second.stop()
        wait_for(
            "the job's group empty (static members: up to its 10 s session)",
            lambda: _members(kafka_bootstrap, job.name) == 0,
            60,
            job.logs,
        )
    first.signal(signal.SIGCONT)
    assert first.wait_exit(60) != 0, first.tail()  # bounded: its next step is a check
    assert "stops before changing anything more" in first.tail(100), first.tail(100)
    if woken_commits:  # past its last check: Kafka's fencing stopped it
        assert "another restore of the job fenced it" in first.tail(100), first.tail(100)
    assert not (job.checkpoint_dir / job.name / "restore-in-progress.json").exists()
    first.start()  # joins the job as a plain worker
    if woken_commits:
        second.start()
    job.verify()  # every order once in Kafka, Parquet and PostgreSQL
    restores = sum(w.log_path.read_text().count("restored job ") for w in job.workers)
    assert restores == 1, job.logs()
    assert first.alive, first.tail()  # not refused as a half-done restore's job
    job.stop_all()


def test_a_corrupt_savepoint_file_is_detected_by_its_checksum(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=2,
        workers=1,
        keyed_by_order=True,
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2"},
    )
    jobs.append(job)
    job.workers[0].start()
    job.produce(5_000)
    wait_running(job)
    # Stage 2 (the running total) holds state only once stage 1's first commit reached it:
    # with every order processed, the savepoint surely has RunningTotal files to corrupt.
    job.wait_until_caught_up()
    path = snapline(job, "savepoint", "create", SPEC, "--stop")
    assert job.workers[0].wait_exit(60) == 0
    victim = next(Path(path, "operators", "RunningTotal").glob("*.parquet"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    worker = job.workers[0]
    worker.start(extra_args=["--from-savepoint", path])
    code = worker.wait_exit(120)
    assert code != 0 and "checksum" in worker.tail(), worker.tail()


def _members(bootstrap: str, group: str) -> int:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    described = admin.describe_consumer_groups([group], request_timeout=10)[group]
    return len(described.result(timeout=15).members)


def _end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """The high watermark of every partition: past everything written so far.

    read_uncommitted, because librdkafka answers a read_committed consumer's watermark query
    with the last stable offset: a killed worker's open transaction then puts the end below
    records another worker committed after it began, and the test counted those (old-job
    outputs of orders in flight at the savepoint) as the restarted job's, as duplicates."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "ends", "isolation.level": "read_uncommitted"}
    )
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in parts
        }
    finally:
        consumer.close()


def _in_flight(bootstrap: str, topic: str, group: str) -> int:
    """Records in ``topic`` past ``group``'s committed offsets (written, not yet consumed)."""
    ends = _end_offsets(bootstrap, topic)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        committed = consumer.committed([TopicPartition(topic, p) for p in ends], timeout=10)
    finally:
        consumer.close()
    return sum(ends[tp.partition] - max(tp.offset, 0) for tp in committed)


def _in_flight_orders(path: str) -> set[int]:
    """Order ids of the savepoint's records in flight in the repartition topic (pyarrow)."""
    if not Path(path, "in-flight").exists():
        return set()
    table = ds.dataset(f"{path}/in-flight", format="parquet").to_table(columns=["value"])
    return {orjson.loads(v)["order_id"] for v in table.column("value").to_pylist()}


def _orders_before(bootstrap: str, topic: str, offsets: dict[str, dict[str, int]]) -> set[int]:
    """Order ids below the savepoint's source offsets: processed before the savepoint."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"b-{time.time_ns()}"})
    ids: set[int] = set()
    limits = {int(p): o for p, o in offsets.get(topic, {}).items()}
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in limits if limits[p] > 0])
        todo = {p for p in limits if limits[p] > 0}
        deadline = time.monotonic() + 60
        while todo and time.monotonic() < deadline:
            for msg in consumer.consume(5000, 0.5):
                if msg.error() is None and msg.offset() < limits[msg.partition()]:
                    ids.add(orjson.loads(msg.value())["order_id"])
                if msg.error() is None and msg.offset() >= limits[msg.partition()] - 1:
                    todo.discard(msg.partition())
        assert not todo, f"could not read the orders below the savepoint offsets: {todo}"
    finally:
        consumer.close()
    return ids


def _read_split(
    bootstrap: str, topic: str, ends: dict[int, int], before: set[int]
) -> list[dict[str, Any]]:
    """Committed outputs of orders processed before the savepoint (written before the crash)
    plus every output written after the restart (at or after ``ends``)."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"split-{time.time_ns()}",
            "isolation.level": "read_committed",
        }
    )
    out: list[dict[str, Any]] = []
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in ends])
        quiet = 0
        while quiet < 4:
            batch = consumer.consume(5000, 0.5)
            quiet = 0 if batch else quiet + 1
            for msg in batch:
                if msg.error() is not None:
                    continue
                value = orjson.loads(msg.value())
                if msg.offset() >= ends[msg.partition()] or value["order_id"] in before:
                    out.append(value)
    finally:
        consumer.close()
    return out


def _max_checkpoint_id(job: WarehouseJob) -> int:
    ids = [0]
    for task in (job.checkpoint_dir / job.name / "tasks").iterdir():
        for chk in task.iterdir():
            if chk.name.startswith("chk-"):
                ids.append(int(chk.name.split("-")[1]))
    return max(ids)


@pytest.mark.spark
def test_savepoint_state_is_readable_by_pyarrow_and_spark_with_per_key_values(
    kafka_bootstrap: str,
    postgres_dsn: str,
    tmp_path: Path,
    unique_name: str,
    jobs: list[Any],
    spark: Any,
) -> None:
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=2,
        workers=1,
        keyed_by_order=True,
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2"},
    )
    jobs.append(job)
    job.workers[0].start()
    job.produce(8_000)
    job.verify()
    job.workers[0].stop()
    path = snapline(job, "savepoint", "from-checkpoint", SPEC)
    assert saved_totals(path) == job.expected
    counts = defaultdict(int)
    for f in Path(path, "operators", "RunningTotal").glob("*.parquet"):
        for r in pq.read_table(f).to_pylist():
            if r["state"] == "count":
                counts[r["key_text"]] += int(r["value_json"])
    assert sum(counts.values()) == job.produced
    # The README's question, answered from state with Spark: the ten largest running totals.
    from pyspark.sql import functions as F

    state = spark.read.parquet(f"{path}/operators/RunningTotal")
    totals = state.where(F.col("state") == "total").select(
        F.col("key_text").alias("customer"), F.col("value_json").cast("long").alias("total")
    )
    assert {r["customer"]: r["total"] for r in totals.collect()} == job.expected
    top = [r["customer"] for r in totals.orderBy(F.desc("total"), "customer").limit(10).collect()]
    assert top == sorted(job.expected, key=lambda c: (-job.expected[c], c))[:10]


def test_an_upgraded_pipeline_goes_through_a_savepoint_and_an_incompatible_one_is_refused(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """Code with one added state and one added operator: refused at a restart from the job's
    checkpoints, which store states by number (``largest`` comes before ``total`` in
    RunningTotal: the worker read its old totals as ``largest`` and started ``total`` from 0,
    silently); through a savepoint (states by name) it restores and continues exactly-once.
    Code that changed a state's kind is refused, naming it."""
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        partitions=2,
        workers=1,
        keyed_by_order=True,
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2"},
    )
    jobs.append(job)
    worker = job.workers[0]
    worker.start()
    job.produce(5_000)
    job.wait_until_caught_up()
    assert worker.stop() == 0, worker.tail()
    worker.env["SNAPLINE_EXAMPLE_VARIANT"] = "upgraded"
    worker.start()
    assert worker.wait_exit(120) == 78, worker.tail()
    tail = worker.tail(80)
    assert "numbered differently" in tail and "'total' of operator 'RunningTotal'" in tail, tail
    assert "savepoint from-checkpoint" in tail
    path = snapline(
        job, "savepoint", "from-checkpoint", SPEC, env={"SNAPLINE_EXAMPLE_VARIANT": "upgraded"}
    )
    worker.env["SNAPLINE_EXAMPLE_VARIANT"] = "incompatible"
    worker.start(extra_args=["--from-savepoint", path])
    assert worker.wait_exit(120) == 78, worker.tail()
    assert "state 'total' of operator 'RunningTotal' is a value state" in worker.tail(80)
    worker.env["SNAPLINE_EXAMPLE_VARIANT"] = "upgraded"
    worker.start(extra_args=["--from-savepoint", path])
    job.produce(5_000)
    job.verify()  # totals continue from the savepoint's state through the added operator
    job.stop_all()


def _first_requests(channel: Any) -> list[Any]:
    """The first non-empty poll of a control channel (bounded: 20 s)."""
    got: list[Any] = []
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        got = channel.poll(every=0)
        time.sleep(0.1)
    return got


def test_a_request_sent_as_soon_as_a_worker_listens_reaches_it(
    kafka_bootstrap: str, unique_name: str
) -> None:
    """A worker's control channel starts at the end offset the broker gives it at once. At
    OFFSET_END it started where its first fetch found the end, which could be after a request
    sent right after the worker joined its group: the request was never read, and `snapline
    savepoint create` waited its whole timeout (seen in CI)."""
    from snapline.pipeline.savepoint import control

    config = {"bootstrap.servers": kafka_bootstrap}
    control.ensure_control_topic(config, unique_name)
    control.send(config, unique_name, "resume", "before")  # older than the worker: not for it
    channel = control.ControlChannel(config, unique_name)
    try:
        control.send(config, unique_name, "savepoint", "now")
        assert [r.id for r in _first_requests(channel)] == ["now"]
    finally:
        channel.close()


def test_paused_workers_hear_holds_while_the_savepoint_is_written(
    kafka_bootstrap: str, unique_name: str
) -> None:
    """Found by review: a worker resumes by itself PAUSE_LIMIT (300 s) after it paused, so an
    export that took longer ran with the job going on (the savepoint now fails then). The CLI
    sends "hold" for its request while it writes; a worker restarts its limit at each."""
    from snapline.pipeline.savepoint import control

    config = {"bootstrap.servers": kafka_bootstrap}
    control.ensure_control_topic(config, unique_name)
    channel = control.ControlChannel(config, unique_name)
    try:
        with control.holding(config, unique_name, "req", every=0.2):
            got: list[control.Request] = []
            deadline = time.monotonic() + 20  # three holds come 0.6 s after the start
            while len(got) < 3 and time.monotonic() < deadline:
                got += channel.poll(every=0)
                time.sleep(0.1)
        assert [(r.id, r.action) for r in got[:3]] == [("req", "hold")] * 3
    finally:
        channel.close()


def test_a_worker_started_while_a_savepoint_waits_finds_the_request_and_takes_part(
    kafka_bootstrap: str, unique_name: str
) -> None:
    """A worker's control channel reads the topic back at start for a savepoint still in
    progress: a request without a resume whose last record (the request, or a hold) is
    younger than the pause limit. It comes with the first poll, once; a resumed request, one
    the CLI stopped speaking of and a --stop request are not for it."""
    from snapline.pipeline.savepoint import control

    config = {"bootstrap.servers": kafka_bootstrap}
    control.ensure_control_topic(config, unique_name)
    control.send(config, unique_name, "savepoint", "done")
    control.send(config, unique_name, "resume", "done")
    # Its CLI died 3 minutes ago (the record's time is the CLI's clock): past 1.5 × HOLD_EVERY.
    producer = Producer(config)
    stale = orjson.dumps({"id": "abandoned", "action": "savepoint", "stop": False})
    producer.produce(
        control.control_topic(unique_name), stale, timestamp=int(time.time() * 1000) - 180_000
    )
    producer.flush(10)
    control.send(config, unique_name, "savepoint", "open")
    control.send(config, unique_name, "hold", "open")
    control.send(config, unique_name, "savepoint", "stopping", stop=True)  # never joined
    channel = control.ControlChannel(config, unique_name)
    try:
        got = channel.poll(every=0)
        assert [(r.id, r.action, r.stop) for r in got] == [("open", "savepoint", False)]
        assert got[0].heard is not None and time.monotonic() - got[0].heard < 60
        control.send(config, unique_name, "resume", "open")
        later = _first_requests(channel)
        assert [(r.id, r.action) for r in later] == [("open", "resume")]  # not again
    finally:
        channel.close()


def test_a_savepoint_completes_when_a_worker_restarts_while_it_waits(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list[Any]
) -> None:
    """w1 is SIGKILLed; `savepoint create` asks the job, w0 commits and pauses, and w1 is
    restarted while the CLI waits for its acknowledgement (a supervisor restarting a crashed
    worker). The restarted w1 started after the request was sent: it used to never hear it,
    and the CLI waited its whole timeout and failed. Now it finds the request in progress,
    restores paused, commits and acknowledges; the savepoint is written and the job goes on,
    every order once in every sink."""
    job = WarehouseJob(kafka_bootstrap, unique_name, tmp_path, postgres_dsn, interval=0.3)
    jobs.append(job)
    w0, w1 = job.workers
    for worker in job.workers:
        worker.start()
    job.produce(4_000)
    wait_running(job)
    w1.kill()
    create = ["savepoint", "create", SPEC, "--timeout", "60"]
    cli = subprocess.Popen(
        [sys.executable, "-m", "snapline.pipeline.cli", *create],
        cwd=job.workdir,
        env=cli_env(job),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        requests = job.checkpoint_dir / job.name / "savepoints" / "_requests"
        wait_for(
            "w0's acknowledgement",
            lambda: any(requests.glob("*/w0.json")),
            60,  # w0 commits and pauses within its checkpoint timeout
            job.logs,
        )
        w1.start()
        # Bounded: the CLI's own --timeout (60 s) plus the export.
        out, err = cli.communicate(timeout=180)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 0, f"savepoint create failed: {err}\n{job.logs()}"
    assert "was requested before this worker started" in w1.log_path.read_text(), w1.tail()
    path = out.strip().splitlines()[-1]
    assert Path(path, "_savepoint.json").exists()
    job.produce(2_000)
    job.verify()  # every order once in Kafka, Parquet and PostgreSQL
    job.stop_all()
