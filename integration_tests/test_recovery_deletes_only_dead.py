"""Recovery deletes only what is provably dead (issue 9, items 1 and 4), on real processes.

- A zombie that re-runs recovery on stale committed offsets, while the new owner commits newer
  checkpoints, must destroy nothing: every sink keeps every committed checkpoint's output and
  every later owner finds the committed checkpoint's files.
- A job pointed at another Kafka cluster is refused at start, and neither its checkpoints nor
  its sink tables are touched.
- Committed offsets that vanished while committed checkpoints are stored stop the job with an
  explicit choice; --restore-latest continues exactly.
- Committed offsets behind a checkpoint Kafka acknowledged (a broker fault) are reported.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from examples.orders import produce_orders
from examples.workers import WorkerProcess, process_state, read_events
from integration_tests.warehouse_job import SPEC, WarehouseJob, snapline, wait_for, wait_frozen
from snapline import LocalKafkaBroker
from snapline.pipeline.checkpoint.metadata import (
    TaskCheckpoint,
    is_marked_committed,
    list_checkpoints,
)
from snapline.pipeline.checkpoint.storage import CheckpointStorage

pytestmark = [pytest.mark.integration, pytest.mark.postgres]


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


class Feeder:
    """Keeps orders trickling in (an idle pipeline takes no checkpoints) until stopped."""

    def __init__(self, job: WarehouseJob, batch: int = 200, pause: float = 0.3) -> None:
        self.job, self.batch, self.pause = job, batch, pause
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            self.job.produce(self.batch)
            time.sleep(self.pause)

    def __enter__(self) -> Feeder:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop_flag.set()
        self.thread.join(60)


@pytest.mark.parametrize(
    "stale_checkpoint", ["still stored", "deleted by retention", "deleted during the restore"]
)
def test_zombie_recovery_on_stale_offsets_destroys_nothing(
    kafka_bootstrap: str,
    postgres_dsn: str,
    tmp_path: Path,
    unique_name: str,
    jobs: list,
    stale_checkpoint: str,
) -> None:
    """The interleaving of issue 9 item 1, forced with freeze points: the zombie read the
    committed offsets of its partition, froze, lost the partition; the owner committed many
    newer checkpoints and froze with one more in flight (state, staged Parquet files and
    staged PostgreSQL rows durable, Kafka not committed yet). The zombie wakes and recovers
    from its stale offsets, then the owner wakes and commits.

    If retention has deleted the checkpoint the stale offsets name, the zombie reads the
    offsets again (they named a deleted checkpoint, so they were stale) instead of failing.
    "deleted during the restore": the zombie froze after it found the checkpoint in storage,
    before it read its files (the long chaos test met it: the worker exited with "checkpoint
    file … is missing"); its restore fails, and the offsets, read again, name a newer one."""
    retained = 1000 if stale_checkpoint == "still stored" else 3
    point = (
        "before_restore_state"
        if stale_checkpoint == "deleted during the restore"
        else "after_offsets_read"
    )
    job = WarehouseJob(
        kafka_bootstrap, unique_name, tmp_path, postgres_dsn, interval=0.3, retained=retained
    )
    jobs.append(job)
    owner, zombie = job.workers
    owner.start()
    job.produce(3000)
    wait_for(
        "first commits",
        lambda: None not in job.committed_checkpoints().values(),
        90,
        job.logs,
    )

    def frozen(worker: WorkerProcess, point: str) -> bool:
        assert worker.proc is not None
        hit = (
            any(
                line.split()[1:] == [str(worker.proc.pid), point]
                for line in worker.fault_log.read_text().splitlines()
            )
            if worker.fault_log.exists()
            else False
        )
        return hit and process_state(worker.proc.pid) == "T"

    with Feeder(job):
        # The zombie joins, gets a partition, reads its committed offsets and freezes right
        # there, before it restored anything.
        zombie.start({"SNAPLINE_FAULT": f"{point}:1:stop"})
        wait_for("zombie frozen", lambda: frozen(zombie, point), 90, job.logs)
        at_freeze = job.committed_checkpoints()
        # Past its session timeout (10 s) the owner takes every partition back and commits
        # newer checkpoints (and, with the default retention, deletes the stale one).
        wait_for(
            "the owner committing newer checkpoints of every partition",
            lambda: all(
                (job.committed_checkpoints()[p] or 0) > (at_freeze[p] or 0) for p in at_freeze
            ),
            120,
            job.logs,
        )
        if stale_checkpoint != "still stored":
            tasks = job.checkpoint_dir / job.name / "tasks"
            wait_for(
                "retention deleting the checkpoints the zombie's offsets name",
                lambda: (
                    not any(
                        any(tasks.glob(f"p{p}/chk-{(c or 0):010d}-*")) for p, c in at_freeze.items()
                    )
                ),
                120,
                job.logs,
            )
        # The owner restarts (static membership: it keeps its partitions) and freezes with
        # its first checkpoint in flight, just before sending its offsets.
        assert owner.stop() == 0
        owner.start({"SNAPLINE_FAULT": "after_metadata_write:1:stop"})
        wait_for("owner frozen", lambda: frozen(owner, "after_metadata_write"), 60, job.logs)
        at_wake = job.committed_checkpoints()
        zombie.signal(signal.SIGCONT)
        woke = time.time()

        def zombie_restore() -> dict | None:
            for event in read_events(zombie.metrics_path):
                if (
                    event.get("worker") == zombie.worker_id
                    and event["event"] == "restored"
                    and event["time"] > woke
                ):
                    return event
            return None

        wait_for("the zombie finishing its recovery", lambda: zombie_restore() is not None, 30)
        owner.signal(signal.SIGCONT)  # well within its session timeout: its commit stands
        restored = zombie_restore()
        assert restored is not None
        stale = {int(t[1:]): c for t, c in restored["checkpoints"].items()}
        assert stale, "the zombie restored no task"
        for partition, checkpoint in stale.items():
            if stale_checkpoint == "still stored":
                # The zombie read stale offsets: it restored the stale checkpoint, or it saw
                # newer checkpoints marked committed in storage and read the offsets again.
                assert (checkpoint or 0) < (at_wake[partition] or 0) or (
                    "they were stale" in zombie.tail(200)
                ), (
                    f"the zombie's recovery of p{partition} used checkpoint {checkpoint}, not "
                    f"stale (committed then: {at_wake[partition]}), and it did not say it "
                    f"read stale offsets: the interleaving did not happen\n{zombie.tail()}"
                )
            elif stale_checkpoint == "deleted by retention":
                assert "they were stale" in zombie.tail(200), zombie.tail()
            else:  # the restore itself failed, and the offsets read again named a newer one
                assert re.search(
                    r"restoring checkpoint \d+ failed .*they were stale", zombie.tail(200)
                ), zombie.tail()
        wait_for(
            "the owner's in-flight checkpoint committing",
            lambda: any((job.committed_checkpoints()[p] or 0) > (at_wake[p] or 0) for p in stale),
            60,
            job.logs,
        )
        time.sleep(3)
        # Whoever restores next must find the committed checkpoint's files.
        for worker in job.workers:
            worker.kill()
            worker.start({"SNAPLINE_FAULT": ""})
        time.sleep(5)
    job.wait_until_caught_up()
    job.verify()
    job.stop_all()
    _assert_no_restore_missed_files(job)


def test_a_job_pointed_at_another_cluster_is_refused(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    job = WarehouseJob(kafka_bootstrap, unique_name, tmp_path, postgres_dsn, workers=1)
    jobs.append(job)
    (worker,) = job.workers
    worker.start()
    job.produce(2000)
    job.wait_until_caught_up()
    assert worker.stop() == 0
    checkpoints = _listing(job.checkpoint_dir)
    table = _listing(job.table)
    rows = len(job.table_rows())
    assert any("chk-" in p for p in checkpoints) and rows == 2000

    with LocalKafkaBroker() as other:
        job.create_topics(other.bootstrap_servers)
        produce_orders(other.bootstrap_servers, job.orders_topic, 500, job.customers, seed=99)
        stranger = job.worker("w0", other.bootstrap_servers)
        job.workers.append(stranger)
        stranger.start()
        assert stranger.wait_exit(120) != 0
        assert "Kafka cluster" in stranger.tail() and "--bootstrap-servers" in stranger.tail()
        assert _listing(job.checkpoint_dir) == checkpoints, "the checkpoints were touched"

        # A fresh checkpoint directory on the other cluster, the same table: refused by the
        # table's commit log before a single row is written.
        fresh = WorkerProcess(
            SPEC, "w0", other.bootstrap_servers, tmp_path / "other-checkpoints", tmp_path, job.env
        )
        job.workers.append(fresh)
        fresh.start()
        assert fresh.wait_exit(120) != 0
        assert "Parquet table" in fresh.tail() and "Kafka cluster" in fresh.tail(), fresh.tail()
    assert _listing(job.table) == table
    assert len(job.table_rows()) == rows, "the table holds rows from the other cluster"


def _delete_group(bootstrap: str, group: str, timeout: float = 60) -> None:
    """Delete the group's committed offsets (a stopped static member stays in the group until
    its session times out, so retry until the group is empty)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin.delete_consumer_groups([group], request_timeout=10)[group].result()
            return
        except Exception as exc:
            assert time.monotonic() < deadline, f"could not delete group {group}: {exc}"
            time.sleep(1)


def test_vanished_offsets_stop_the_job_until_the_user_chooses(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    job = WarehouseJob(kafka_bootstrap, unique_name, tmp_path, postgres_dsn, workers=1)
    jobs.append(job)
    (worker,) = job.workers
    worker.start()
    job.produce(3000)
    job.wait_until_caught_up()
    assert worker.stop() == 0
    _delete_group(kafka_bootstrap, job.name)  # as if offsets.retention.minutes had passed
    checkpoints = _listing(job.checkpoint_dir)

    worker.start()
    assert worker.wait_exit(120) != 0
    tail = worker.tail()
    assert "no committed offsets" in tail and "--restore-latest" in tail, tail
    assert "--reset-state" in tail
    assert _listing(job.checkpoint_dir) == checkpoints, "the checkpoints were touched"

    worker.start(extra_args=["--restore-latest"])
    job.produce(2000)
    job.wait_until_caught_up()
    assert worker.stop() == 0
    job.verify()  # the final checkpoint was marked committed: nothing processed twice

    _delete_group(kafka_bootstrap, job.name)
    old = {p.split("/")[3] for p in _listing(job.checkpoint_dir) if "/chk-" in p}
    worker.start(extra_args=["--reset-state"])
    job.wait_until_caught_up()
    assert worker.stop() == 0
    assert "--reset-state deletes" in worker.tail(200)
    now = {p.split("/")[3] for p in _listing(job.checkpoint_dir) if "/chk-" in p}
    assert old and not (old & now), "--reset-state kept the old checkpoints"


def _marked(job: WarehouseJob) -> set[str]:
    """The checkpoint directories (task/chk-...) marked committed."""
    storage = CheckpointStorage(str(job.checkpoint_dir))
    return {
        f"p{p}/{ref.directory(job.name, f'p{p}').rsplit('/', 1)[1]}"
        for p in range(job.partitions)
        for ref in list_checkpoints(storage, job.name, f"p{p}")
        if is_marked_committed(storage, job.name, f"p{p}", ref)
    }


def _run_until_checkpoints(job: WarehouseJob, worker: WorkerProcess, count: int) -> None:
    """Run the worker with orders trickling in until it took ``count`` checkpoints, then stop
    it once it caught up."""
    with Feeder(job):
        worker.start()
        wait_for(
            f"{count} checkpoints",
            lambda: (
                sum(e["event"] == "checkpoint" for e in read_events(worker.metrics_path)) >= count
            ),
            90,
            worker.tail,
        )
    job.wait_until_caught_up()
    assert worker.stop() == 0


def _assert_no_restore_missed_files(job: WarehouseJob) -> None:
    """No worker's restore found a committed checkpoint's files (or staged files) gone; a
    restore of a checkpoint its stale offsets named, deleted under it and replaced by the
    one the offsets name now, is the zombie's own (its line says "they were stale")."""
    logs = "\n".join(
        line
        for w in job.workers
        for line in w.log_path.read_text(errors="replace").splitlines()
        if "they were stale" not in line
    )
    assert "is missing" not in logs and "is gone" not in logs, job.logs()


def _restores(worker: WorkerProcess, since: float) -> list[dict]:
    """The worker's restores of an assignment after ``since`` (metrics events)."""
    return [
        e
        for e in read_events(worker.metrics_path)
        if e["event"] == "restored" and e["time"] > since and e.get("worker") == worker.worker_id
    ]


def test_a_zombie_with_reset_state_deletes_nothing_of_the_live_owner(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    """The job's offsets vanished and both workers run with --reset-state. One read 'no
    committed offsets', then froze past its session timeout; the other took every partition,
    reset it and committed new checkpoints. The woken zombie must not take its stale read for
    a reason to delete: the owner's committed checkpoints stay, and a later restore finds the
    files of the checkpoint Kafka's offsets name. (Before: it deleted every stored checkpoint
    of its tasks, the owner's committed ones included.)"""
    job = WarehouseJob(
        kafka_bootstrap, unique_name, tmp_path, postgres_dsn, interval=0.3, retained=1000
    )
    jobs.append(job)
    owner, zombie = job.workers
    owner.start()
    job.produce(2000)
    job.wait_until_caught_up()
    assert owner.stop() == 0
    _delete_group(kafka_bootstrap, job.name)  # as if offsets.retention.minutes had passed

    with Feeder(job):
        zombie.start({"SNAPLINE_FAULT": "after_offsets_read:1:stop"}, ["--reset-state"])
        wait_for(
            "zombie frozen after reading no offsets",
            lambda: (
                zombie.fault_log.exists()
                and zombie.proc is not None
                and process_state(zombie.proc.pid) == "T"
            ),
            90,
            job.logs,
        )
        owner.start(extra_args=["--reset-state"])
        # Past the zombie's session timeout (10 s) the owner has every partition, resets it
        # and commits new checkpoints.
        wait_for(
            "the owner committing new checkpoints of every partition",
            lambda: None not in job.committed_checkpoints().values(),
            120,
            job.logs,
        )
        named = job.committed_checkpoints()
        wait_for("the owner's checkpoints marked committed", lambda: bool(_marked(job)), 30)
        owners = _marked(job)
        zombie.signal(signal.SIGCONT)
        woke = time.time()
        wait_for("the zombie finishing its recovery", lambda: _restores(zombie, woke), 60, job.logs)
        left = _marked(job)
        assert owners <= left, f"the zombie deleted the owner's checkpoints {owners - left}"
        assert "they were stale" in zombie.tail(200), zombie.tail()
        # Whoever restores next must find the files of the checkpoint Kafka's offsets name.
        zombie.kill()
        owner.kill()
        restarted = time.time()
        owner.start()
        wait_for("the owner's restore after the kill", lambda: _restores(owner, restarted), 60)
    restored = _restores(owner, restarted)[-1]
    for task, checkpoint in restored["checkpoints"].items():
        assert checkpoint is not None and checkpoint >= (named[int(task[1:])] or 0), restored
    job.wait_until_caught_up()
    _assert_no_restore_missed_files(job)


def test_after_reset_state_postgres_takes_the_new_output(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    """--reset-state deletes the job's committed checkpoints; if the job then stops before it
    stores a new one, the next start finds no checkpoint at all. Checkpoint ids must still go
    on above the deleted ones: the PostgreSQL sink keeps a key's row of the higher id, so
    ids starting again at 1 had every key the old output wrote refuse the new output, and the
    table silently kept the old totals."""
    job = WarehouseJob(kafka_bootstrap, unique_name, tmp_path, postgres_dsn, workers=1)
    jobs.append(job)
    (worker,) = job.workers
    _run_until_checkpoints(job, worker, 10)
    _delete_group(kafka_bootstrap, job.name)  # as if offsets.retention.minutes had passed
    # The reset runs, and the worker dies at its first new checkpoint, before storing it.
    worker.start({"SNAPLINE_FAULT": "sync_snapshot:1"}, ["--reset-state"])
    assert worker.wait_exit(90) != 0
    assert "--reset-state deletes" in worker.tail(200), worker.tail()
    storage = CheckpointStorage(str(job.checkpoint_dir))
    assert not any(list_checkpoints(storage, job.name, f"p{p}") for p in range(job.partitions)), (
        "a checkpoint was stored after the reset: the case under test did not happen"
    )
    worker.start()  # no offsets and no checkpoints: a fresh start over all the input
    job.produce(500)
    job.wait_until_caught_up()

    def totals() -> dict[str, int]:
        return {c: t for c, (t, _) in job.database().items()}

    wait_for("PostgreSQL holding every order's total", lambda: totals() == job.expected, 30)
    assert worker.stop() == 0


def test_offsets_behind_an_acknowledged_checkpoint_are_reported(
    kafka_bootstrap: str, postgres_dsn: str, tmp_path: Path, unique_name: str, jobs: list
) -> None:
    """A broker that loses the offsets of a transaction it acknowledged (it can skip the
    markers of a commit when it restarts mid-commit, docs/exactly-once.md) leaves committed
    offsets that name a checkpoint older than one storage records as committed. The broker
    fault is reproduced here by committing the older checkpoint's offsets to the stopped
    job's group; the worker must say so (log, event) rather than replay silently, restore
    what the offsets name."""
    job = WarehouseJob(kafka_bootstrap, unique_name, tmp_path, postgres_dsn, workers=1)
    jobs.append(job)
    (worker,) = job.workers
    _run_until_checkpoints(job, worker, 4)  # so an older committed checkpoint is retained
    storage = CheckpointStorage(str(job.checkpoint_dir))
    refs = {
        task: [
            r
            for r in list_checkpoints(storage, job.name, task)
            if is_marked_committed(storage, job.name, task, r)
        ]
        for task in ("p0", "p1")
    }
    assert all(len(r) >= 2 for r in refs.values()), refs
    rewound = []  # every task's offsets go back to its oldest retained committed checkpoint
    for task, committed in refs.items():
        positions = TaskCheckpoint.read(storage, job.name, task, committed[0]).positions
        rewound += [
            TopicPartition(t, p, off, metadata=committed[0].offset_metadata())
            for (t, p), off in positions.items()
        ]
    _delete_group(kafka_bootstrap, job.name)  # an empty group accepts a plain offset commit
    rewind = Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": job.name, "enable.auto.commit": False}
    )
    try:
        rewind.commit(offsets=rewound, asynchronous=False)
    finally:
        rewind.close()

    worker.start()
    # The event of a task is written before its "restored from" line is logged: wait for both.
    wait_for(
        "kafka_lost_commit events and restores of both tasks",
        lambda: (
            len([e for e in read_events(worker.metrics_path) if e["event"] == "kafka_lost_commit"])
            >= 2
            and all(
                f"task {task} restored from checkpoint {committed[0].checkpoint_id} "
                in worker.tail(200)
                for task, committed in refs.items()
            )
        ),
        60,
        worker.tail,
    )
    events = {
        e["task"]: e for e in read_events(worker.metrics_path) if e["event"] == "kafka_lost_commit"
    }
    tail = worker.tail(200)
    assert "lost the offsets of an acknowledged transaction" in tail, tail
    for task, committed in refs.items():
        older, newest = committed[0], committed[-1]
        event = events[task]
        assert event["offsets_name"] == older.checkpoint_id, event
        assert newest.checkpoint_id in event["acknowledged"], event
        assert f"task {task} restored from checkpoint {older.checkpoint_id} " in tail, tail
    assert worker.stop() == 0


@pytest.mark.parametrize("restore", ["keeps-the-topics", "replaces-the-topics"])
def test_a_zombie_woken_after_a_savepoint_restore_deletes_no_record_of_the_new_topics(
    kafka_bootstrap: str,
    postgres_dsn: str,
    tmp_path: Path,
    unique_name: str,
    jobs: list,
    restore: str,
) -> None:
    """A worker deletes the repartition records below its committed positions. One frozen
    past its session timeout is no member of the group, so the job counts as stopped: a
    savepoint is made from its checkpoints and restored, and the restored job runs on. The
    restore created the repartition topics again; the woken zombie deleted the records of
    the new topics below its old offsets, records the new job had not necessarily read. Its
    topic id check and its DeleteRecords (by topic name) are two steps, and a freshness bound
    on the check leaves a freeze after it: librdkafka sends a request queued before a freeze
    once the process wakes. Here the zombie freezes exactly there (``repartition_delete_fresh``:
    its check found fresh, the request not sent) and sends its delete after the restore.
    - "keeps-the-topics": the restore emptied the topics and their offsets went on, so the
      delete reaches only records below the restored job's.
    - "replaces-the-topics" (4 partitions -> 2; Kafka cannot remove partitions): the restore
      created the topic again under its name, offsets from 0, and the delete removed records
      in flight (the restored job stopped at them, exit 78). Now it replaces the topic by one
      of a new name (``<job>.by-customer.g1.repartition``) and deletes the old one, so the
      delete finds no topic.
    The new job keeps every repartition record (SNAPLINE_TEST_KEEP_REPARTITION_RECORDS), so
    any record deleted from its topics after the restore is the zombie's doing; the job's
    output is verified too. (The freshness bound itself:
    tests/runtime/test_repartition_delete.py.)"""
    replaces = restore == "replaces-the-topics"
    job = WarehouseJob(
        kafka_bootstrap,
        unique_name,
        tmp_path,
        postgres_dsn,
        interval=0.3,
        retained=1,
        keyed_by_order=True,
        extra_env={"SNAPLINE_EXAMPLE_STAGES": "2"}
        | ({"SNAPLINE_EXAMPLE_PARTITIONS": "4"} if replaces else {}),
    )
    jobs.append(job)
    zombie, restored = job.workers
    old_topic = f"{job.name}.by-customer.repartition"
    topic = f"{job.name}.by-customer.g1.repartition" if replaces else old_topic
    zombie.start()
    job.produce(3000)
    job.wait_until_caught_up()
    assert zombie.stop() == 0, zombie.tail()
    # Restarted from its committed positions (~1,500 or ~750 records per repartition
    # partition), it freezes at its first deletion, its topic id check passed and fresh, the
    # delete not sent. Once woken it sends it and dies when the broker has answered; it never
    # rejoins the group (as a member of the restored job it would delete what that job has
    # read, rightly).
    zombie.start(
        {"SNAPLINE_FAULT": "repartition_delete_fresh:1:stop,after_repartition_delete:1:kill"}
    )
    job.produce(200)
    wait_frozen(zombie, "the zombie frozen before sending a deletion", 90, job.logs)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})

    def members() -> int:
        group = admin.describe_consumer_groups([job.name], request_timeout=10)[job.name]
        return len(group.result(timeout=15).members)

    wait_for("the zombie's session timing out (10 s)", lambda: members() == 0, 60, job.logs)
    path = snapline(job, "savepoint", "from-checkpoint", SPEC)
    keep = {"SNAPLINE_TEST_KEEP_REPARTITION_RECORDS": "1"}
    if replaces:  # 4 partitions -> 2: the restore replaces the topics
        keep["SNAPLINE_EXAMPLE_PARTITIONS"] = "2"
    restored.start(keep, ["--from-savepoint", path])
    job.produce(6000)  # the topics' ends pass the zombie's old positions even from 0
    job.wait_until_caught_up()
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"v-{unique_name}"})
    try:
        topics = consumer.list_topics(timeout=10).topics
        partitions = range(len(topics[topic].partitions))
        if replaces:
            assert len(partitions) == 2, "the restore did not replace the topic"
            assert old_topic not in topics, "the replaced topic was not deleted"

        def lows() -> list[int]:
            return [
                consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[0]
                for p in partitions
            ]

        restored_from = lows()  # where the restore left them
        zombie.signal(signal.SIGCONT)
        # Killed once the broker answered its deletion (in a topic that is gone: an error).
        assert zombie.wait_exit(60) == -signal.SIGKILL, zombie.tail(100)
        assert lows() == restored_from, f"topics cut at {lows()}\n{zombie.tail(100)}"
        points = [line.split()[2] for line in zombie.fault_log.read_text().splitlines()]
        assert points == ["repartition_delete_fresh", "after_repartition_delete"], points
    finally:
        consumer.close()
    job.verify()
    job.stop_all()


def _table_ns(table: Path) -> list[int]:
    """The ``n`` of every row the Parquet table publishes (staging and commit logs are in
    ``_``-prefixed directories, which readers skip)."""
    import pyarrow.parquet as pq

    files = sorted(table.glob("*.parquet"))
    return sorted(n for f in files for n in pq.read_table(f).column("n").to_pylist())


def test_reset_state_publishes_what_the_newest_committed_checkpoint_staged(
    kafka_bootstrap: str, tmp_path: Path, unique_name: str
) -> None:
    """Found by review: a worker died between Kafka's commit of checkpoint c and its Parquet
    sink's publish; its restart restored c (marking it committed) and died before the sinks'
    recovery; the job's offsets then expired. --reset-state deleted c, and the fresh task's
    first commit discarded what c had staged as an uncommitted epoch's: Kafka held c's
    records, the table never did (a "latest" source does not read them again). The table must
    hold exactly the records Kafka's output holds, each once, c's among them."""
    import orjson
    from confluent_kafka import Producer

    from examples.orders import create_topics, read_committed

    prefix = f"{unique_name}-"
    source, out = f"{prefix}copy-in", f"{prefix}copy-out"
    create_topics(kafka_bootstrap, {source: 1, out: 1})
    table = tmp_path / "table"
    env = {"SNAPLINE_TEST_PREFIX": prefix, "SNAPLINE_TEST_TABLE": str(table)}
    worker = WorkerProcess(
        "integration_tests.pipelines:latest_copy_parquet",
        "w0",
        kafka_bootstrap,
        tmp_path / "chk",
        tmp_path,
        env,
    )
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def produce(numbers: range) -> None:
        for n in numbers:
            producer.produce(source, orjson.dumps({"n": n}), partition=0)
        assert producer.flush(30) == 0

    def wait_restores(count: int) -> None:
        deadline = time.monotonic() + 60  # a restore takes seconds
        while sum(e.get("event") == "restored" for e in read_events(worker.metrics_path)) < count:
            assert time.monotonic() < deadline, worker.tail()
            time.sleep(0.1)

    worker.start()
    try:
        wait_restores(1)
        produce(range(0, 20))
        read_committed(kafka_bootstrap, out, 20, timeout=60, settle=1)
        time.sleep(1.0)  # the checkpoint of the last records has committed (interval 0.3 s)
    finally:
        assert worker.stop() == 0, worker.tail()
    # c: the next checkpoint commits in Kafka, and the worker dies before its sinks hear it.
    produce(range(100, 120))
    worker.start({"SNAPLINE_FAULT": "after_kafka_commit:1"})
    assert worker.wait_exit(90) == -signal.SIGKILL, worker.tail()
    # The restart restores c and marks it committed, then dies before the sinks' recovery.
    worker.start({"SNAPLINE_FAULT": "before_sink_recovery:1"})
    assert worker.wait_exit(90) == -signal.SIGKILL, worker.tail()
    before = sorted(r["n"] for r in read_committed(kafka_bootstrap, out, 21, timeout=10))
    from_c = [n for n in before if n >= 100]
    assert from_c, f"checkpoint c committed nothing: the test proves nothing ({before})"
    published = [n for n in _table_ns(table) if n >= 100]
    assert published == [], f"c's records were published before the reset: {published}"
    _delete_group(kafka_bootstrap, f"{prefix}job")  # as if offsets.retention.minutes had passed
    worker.start(extra_args=["--reset-state"])
    try:
        wait_restores(3)  # two earlier starts finished a restore (not the one killed in it)
        produce(range(200, 220))  # the fresh task's first commits
        expected = len(before) + 20
        kafka = sorted(r["n"] for r in read_committed(kafka_bootstrap, out, expected, timeout=60))
        time.sleep(1.0)  # the checkpoint of the last records has committed (interval 0.3 s)
    finally:
        assert worker.stop() == 0, worker.tail()
    assert "--reset-state deletes its" in worker.tail(400), worker.tail()
    assert kafka == sorted(set(kafka)), "a record twice in Kafka"
    assert [*range(20), *range(200, 220)] == [n for n in kafka if not 100 <= n < 120]
    assert _table_ns(table) == kafka
