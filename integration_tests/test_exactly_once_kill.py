"""Exactly-once under SIGKILL: real broker, real worker processes, an independent reader.

Every test produces orders with unique ids, runs workers of the running-total example,
breaks them, and then checks with a ``read_committed`` consumer that every order's effect
appears exactly once and each customer's final total equals the sum of its orders. The two
SIGKILL tests also run the example's rolling count (``key_by().count()``, whose counts wait
decoded in its operator across epochs) and check that each customer's counts are 1..n, each
once, n its number of orders.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.workers import WorkerProcess, fault_hits, process_state, read_events
from integration_tests.client_versions import NEWEST, side_installed
from snapline.pipeline.supervisor import EX_SUPERSEDED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPEC = "examples.running_total:pipeline"
PARTITIONS = 4
CUSTOMERS = 2000


class Job:
    """Topics, checkpoint dir and workers of one running-total job."""

    def __init__(
        self,
        bootstrap: str,
        name: str,
        tmp: Path,
        *,
        backend: str = "memory",
        interval: float = 0.5,
        workers: int = 2,
        extra_env: dict[str, str] | None = None,
        counts: bool = False,
    ):
        self.bootstrap = bootstrap
        self.name = name
        self.prefix = f"{name}-"
        self.counts = counts
        topics = [f"{self.prefix}orders", f"{self.prefix}customer-totals"]
        if counts:
            topics.append(f"{self.prefix}customer-counts")
        create_topics(bootstrap, dict.fromkeys(topics, PARTITIONS))
        env = {
            "SNAPLINE_EXAMPLE_COUNTS": "1" if counts else "",
            "SNAPLINE_EXAMPLE_PREFIX": self.prefix,
            "SNAPLINE_EXAMPLE_JOB": name,
            "SNAPLINE_EXAMPLE_BACKEND": backend,
            "SNAPLINE_EXAMPLE_INTERVAL": str(interval),
            **(extra_env or {}),
        }
        self.workdir = tmp
        self.workers = [
            WorkerProcess(SPEC, f"w{i}", bootstrap, tmp / "checkpoints", tmp, env)
            for i in range(workers)
        ]
        self.expected: dict[str, int] = {}
        self.produced = 0

    def produce(self, count: int) -> None:
        totals = produce_orders(
            self.bootstrap, f"{self.prefix}orders", count, CUSTOMERS, start_id=self.produced
        )
        for customer, amount in totals.items():
            self.expected[customer] = self.expected.get(customer, 0) + amount
        self.produced += count

    def produce_in_background(self, total: int, waves: int) -> threading.Thread:
        def run() -> None:
            for _ in range(waves):
                self.produce(total // waves)
                time.sleep(0.5)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def verify(self, timeout: float = 180) -> None:
        outputs = read_committed(
            self.bootstrap,
            f"{self.prefix}customer-totals",
            self.produced,
            timeout=timeout,
            settle=3.0,
        )
        result = verify_totals(outputs, self.expected, range(self.produced))
        assert result.ok, result.summary() + "\n" + self.logs()
        if self.counts:
            self._verify_counts(outputs, timeout)

    def _verify_counts(self, totals: list[dict[str, Any]], timeout: float) -> None:
        """Each customer's rolling counts are 1..n, each exactly once (n: its orders, which
        ``verify_totals`` checked in the totals)."""
        orders = Counter(o["customer"] for o in totals)
        counts = read_committed(
            self.bootstrap,
            f"{self.prefix}customer-counts",
            self.produced,
            timeout=timeout,
            settle=3.0,
        )
        seen: dict[str, list[int]] = defaultdict(list)
        for c in counts:
            seen[c["key"]].append(c["value"])
        wrong = {
            customer: sorted(seen.get(customer, []))[:10]
            for customer, n in orders.items()
            if sorted(seen.get(customer, [])) != list(range(1, n + 1))
        }
        assert len(counts) == self.produced and not wrong and set(seen) == set(orders), (
            f"{len(counts)} counts for {self.produced} orders; customers with wrong counts "
            f"({len(wrong)}): {dict(list(wrong.items())[:5])}\n{self.logs()}"
        )

    def wait_until_caught_up(self, timeout: float = 180) -> None:
        """Until the workers committed offsets for every produced order (or timeout)."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": self.name})
        topic = f"{self.prefix}orders"
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                committed = consumer.committed(
                    [TopicPartition(topic, p) for p in range(PARTITIONS)], timeout=10
                )
                ends = [
                    consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                    for p in range(PARTITIONS)
                ]
                if all(c.offset >= e for c, e in zip(committed, ends, strict=True)):
                    return
                time.sleep(1)
        finally:
            consumer.close()
        raise AssertionError("workers did not catch up\n" + self.logs())

    def logs(self) -> str:
        return "\n".join(f"--- {w.worker_id}\n{w.tail()}" for w in self.workers)

    def stop_all(self) -> None:
        for worker in self.workers:
            if worker.alive:
                worker.stop()


@pytest.fixture
def job_factory(kafka_bootstrap: str, tmp_path: Path, unique_name: str) -> Iterator:
    jobs: list[Job] = []

    def make(**kwargs: object) -> Job:
        job = Job(
            kafka_bootstrap, f"{unique_name}-{len(jobs)}", tmp_path / f"job{len(jobs)}", **kwargs
        )  # type: ignore[arg-type]
        job.workdir.mkdir(parents=True, exist_ok=True)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        for worker in job.workers:
            worker.kill()


BACKENDS = ["memory", "rocksdb"]


def kill_until_produced(
    job: Job,
    producer: threading.Thread,
    rng: random.Random,
    at_least: int,
    env: dict[str, str] | None = None,
) -> int:
    """SIGKILL a random worker at random moments and restart it, at least ``at_least`` times
    and until the producer is done (it ends: it produces a fixed count); the kills made."""
    kills = 0
    while kills < at_least or producer.is_alive():
        time.sleep(rng.uniform(0.3, 2.0))
        victim = rng.choice(job.workers)
        victim.kill()
        kills += 1
        time.sleep(rng.uniform(0.0, 0.5))
        victim.start(env)
    producer.join()
    return kills


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_sigkills_lose_and_duplicate_nothing(job_factory, backend: str) -> None:
    """2 workers, ≥ 200k orders, ≥ 20 SIGKILLs of a random worker at random moments."""
    job = job_factory(backend=backend, interval=0.5, counts=True)
    for worker in job.workers:
        worker.start()
    producer = job.produce_in_background(200_000, waves=40)
    kills = kill_until_produced(job, producer, random.Random(42), at_least=20)
    job.wait_until_caught_up()
    job.verify()
    job.stop_all()
    assert kills >= 20 and job.produced >= 200_000


def test_workers_on_the_newest_client_the_pin_admits_are_exactly_once_under_kills(
    job_factory,
) -> None:
    """CI installs confluent-kafka 2.12 (the bench extra's Quix Streams holds it below 2.13);
    ``pip install snapline`` alone takes the newest release the pin admits. Here both
    workers run on that release (``client_versions.NEWEST``, installed beside the other),
    restore inside their rebalance callbacks at every start and rebalance, and are killed
    8 times. From 2.16 a Consumer admits one thread at a time: a worker that called the
    consumer from a helper thread inside the callback hung at its first assignment."""
    env = {"PYTHONPATH": str(side_installed(NEWEST))}
    job = job_factory(backend="rocksdb", interval=0.5, counts=True)
    for worker in job.workers:
        worker.start(env)
    producer = job.produce_in_background(40_000, waves=10)
    kill_until_produced(job, producer, random.Random(16), at_least=8, env=env)
    job.wait_until_caught_up()
    job.verify()
    job.stop_all()
    for worker in job.workers:
        assert f"confluent-kafka {NEWEST}," in worker.log_path.read_text("utf-8", "replace")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_kill_point_is_survived(job_factory, backend: str) -> None:
    """Kill at each protocol point ≥ 3 times: sync snapshot, mid-materialization, after the
    metadata write (before the Kafka commit), after the Kafka commit (before notification)."""
    odds = {
        "sync_snapshot": 0.08,
        "mid_materialization": 0.08,
        "after_metadata_write": 0.15,
        "after_kafka_commit": 0.15,
    }
    job = job_factory(backend=backend, interval=0.3, counts=True)
    fault_log = job.workers[0].fault_log

    def spec() -> str:
        hits = fault_hits(fault_log)
        return ",".join(f"{p}:{o}" for p, o in odds.items() if hits.get(p, 0) < 3)

    for worker in job.workers:
        worker.start({"SNAPLINE_FAULT": spec()})
    job.produce(20_000)
    deadline = time.monotonic() + 400
    while spec() and time.monotonic() < deadline:
        time.sleep(0.3)
        for worker in job.workers:
            if not worker.alive:
                worker.start({"SNAPLINE_FAULT": spec()})
        # keep a trickle of input after the first 150k: an idle pipeline writes no
        # checkpoints, so the kill points could not be hit any more
        job.produce(2_000 if job.produced < 150_000 else 200)
    hits = fault_hits(fault_log)
    assert all(hits.get(p, 0) >= 3 for p in odds), f"kill points hit: {hits}\n{job.logs()}"
    for worker in job.workers:  # finish without faults
        if worker.alive:
            worker.kill()
        worker.start({"SNAPLINE_FAULT": ""})
    job.wait_until_caught_up()
    job.verify()
    job.stop_all()


def test_zombie_worker_commits_nothing(job_factory) -> None:
    """A worker frozen past its session timeout loses its partitions; when it wakes up, its
    stale epoch must not commit (group-generation fencing of the offset commit)."""
    job = job_factory(interval=0.5)
    a, b = job.workers
    a.start()
    b.start()
    job.produce(20_000)
    time.sleep(8)
    producer = job.produce_in_background(40_000, waves=20)
    time.sleep(1)
    a.signal(signal.SIGSTOP)
    frozen_at = time.time()

    def b_took_over_yet() -> bool:
        return any(
            e.get("worker") == b.worker_id
            and e.get("event") == "assigned"
            and e["time"] > frozen_at
            for e in read_events(a.metrics_path)
        )

    # > session.timeout.ms (10 s): b takes over a's partitions (bounded: 60 s)
    deadline = time.monotonic() + 60
    while not b_took_over_yet():
        assert time.monotonic() < deadline, "b never took over\n" + job.logs()
        time.sleep(0.5)
    a.signal(signal.SIGCONT)
    resumed_at = time.time()
    producer.join()
    job.wait_until_caught_up()
    job.verify()
    job.stop_all()
    events = read_events(a.metrics_path)
    a_events = [e for e in events if e.get("worker") == a.worker_id and e["time"] > frozen_at]
    b_took_over = [
        e
        for e in events
        if e.get("worker") == b.worker_id
        and e.get("event") == "assigned"
        and frozen_at < e["time"] < resumed_at
    ]
    assert b_took_over, "the other worker never took over while a was frozen\n" + job.logs()
    reassigned = next((e["time"] for e in a_events if e.get("event") == "assigned"), None)
    zombie_commits = [
        e
        for e in a_events
        if e.get("event") == "checkpoint" and (reassigned is None or e["time"] < reassigned)
    ]
    assert not zombie_commits, f"zombie committed {zombie_commits}\n{job.logs()}"


@pytest.mark.parametrize(
    ("point", "abort_departed"),
    [
        ("after_metadata_write", True),
        ("after_offsets_sent", True),
        ("after_offsets_sent", False),
    ],
)
def test_zombie_woken_inside_the_commit_protocol(
    job_factory, point: str, abort_departed: bool
) -> None:
    """Worker a freezes itself (SIGSTOP) inside the commit protocol, b takes its partitions,
    then a is woken and carries on from exactly that point.

    - ``after_metadata_write``: a has not sent its offsets yet; when it does, the group
      coordinator rejects its stale generation, so nothing of that epoch commits.
    - ``after_offsets_sent``: a's offsets were accepted while it was still a member and wait
      in its open transaction; b's offset fetch for those partitions cannot read them
      (KIP-447 stable offsets), so it cannot start from the older offsets. b finds a, the
      writer of the tasks' newest checkpoint, gone from the group and aborts its transaction:
      b restores before a wakes, and a's late commit fails. With that abort turned off
      (``SNAPLINE_ABORT_DEPARTED=0``) b waits for a's transaction instead, and a's late commit
      stands. Either way: every order's effect exactly once.
    """
    job = job_factory(
        interval=0.5, extra_env={} if abort_departed else {"SNAPLINE_ABORT_DEPARTED": "0"}
    )
    a, b = job.workers
    b.start()
    job.produce(10_000)
    time.sleep(3)
    a.start({"SNAPLINE_FAULT": f"{point}:1:stop"})
    producer = job.produce_in_background(40_000, waves=40)
    deadline = time.monotonic() + 120
    while not fault_hits(a.fault_log).get(point) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fault_hits(a.fault_log).get(point), f"a never reached {point}\n" + job.logs()
    assert a.proc is not None
    # The hit is logged (and fsynced) before the SIGSTOP: bounded, the stop follows at once.
    deadline = time.monotonic() + 30
    while process_state(a.proc.pid) != "T":
        assert time.monotonic() < deadline, "a did not freeze itself"
        time.sleep(0.1)
    frozen_at = time.time()
    time.sleep(20)  # > session.timeout.ms (10 s), < transaction.timeout.ms (60 s)
    a.signal(signal.SIGCONT)
    resumed_at = time.time()
    producer.join()
    job.wait_until_caught_up()
    job.verify()
    job.stop_all()

    events = read_events(a.metrics_path)
    mine = [e for e in events if e.get("worker") == a.worker_id]
    theirs = [e for e in events if e.get("worker") == b.worker_id]
    after_wake = [e for e in mine if e["time"] > resumed_at]
    first = next((e for e in after_wake if e["event"] in ("checkpoint", "checkpoint_failed")), None)
    b_assigned = [e for e in theirs if e["event"] == "assigned" and e["time"] > frozen_at]
    assert b_assigned, "b never took over while a was frozen\n" + job.logs()
    b_restored = next(
        e for e in theirs if e["event"] == "restored" and e["time"] > b_assigned[0]["time"]
    )
    if point == "after_metadata_write" or abort_departed:
        assert first is not None and first["event"] == "checkpoint_failed", (
            f"the zombie's first act after waking was {first}, not a failed commit\n" + job.logs()
        )
    if point == "after_offsets_sent" and abort_departed:
        fenced = [e for e in theirs if e["event"] == "fenced_departed" and e["departed"] == "w0"]
        assert fenced, "b did not abort the frozen a's transaction\n" + job.logs()
        assert b_restored["time"] < resumed_at, (
            "b waited for the frozen a's pending offsets instead of aborting its transaction: "
            f"restored at {b_restored['time']:.1f}, a woke at {resumed_at:.1f}"
        )
    if point == "after_offsets_sent" and not abort_departed:
        assert first is not None and first["event"] == "checkpoint", (
            f"a's offsets were accepted while it was a member, so its commit stands; "
            f"its first act after waking was {first}\n" + job.logs()
        )
        assert b_restored["time"] >= resumed_at, (
            "b started on a's partitions before a's pending transactional offsets were "
            f"resolved: restored at {b_restored['time']:.1f}, a woke at {resumed_at:.1f}"
        )


def test_a_zombie_replaced_by_a_worker_with_its_id_stops_instead_of_fencing_it(
    job_factory, tmp_path: Path
) -> None:
    """Worker w0 freezes (SIGSTOP: a paused VM), and its orchestrator starts a replacement
    with the same worker id on another host (its own local directory, the same checkpoint
    storage). The replacement's start fences the frozen one's producer and consumer. When the
    old process wakes, it must stop (exit 79, naming the successor) rather than replace its
    fenced clients, which would fence the replacement in turn; and so must a restart of it on
    its host. The replacement fails no checkpoint and replaces no client after the wake, and
    every order's effect is there exactly once."""
    job = job_factory(interval=0.5, workers=1)
    (zombie,) = job.workers
    zombie.start()
    job.produce(10_000)

    def committed_by(worker: WorkerProcess, since: float) -> bool:
        return any(
            e["event"] == "checkpoint" and e["time"] > since
            for e in read_events(worker.metrics_path)
        )

    started = time.time()
    deadline = time.monotonic() + 90  # bounded: the worker commits within seconds
    while not committed_by(zombie, started):
        assert time.monotonic() < deadline, "the first worker never committed\n" + job.logs()
        time.sleep(0.2)
    producer = job.produce_in_background(30_000, waves=30)
    time.sleep(1)
    zombie.signal(signal.SIGSTOP)
    host2 = tmp_path / "host2"
    host2.mkdir()
    successor = WorkerProcess(
        SPEC, zombie.worker_id, job.bootstrap, job.workdir / "checkpoints", host2, zombie.env
    )
    successor.start(extra_args=["--local-dir", str(host2 / "local")])
    try:
        replaced_at = time.time()
        deadline = time.monotonic() + 90  # bounded: join, restore, a checkpoint
        while not committed_by(successor, replaced_at):
            assert time.monotonic() < deadline, "the successor never committed\n" + (
                successor.tail()
            )
            time.sleep(0.2)
        zombie.signal(signal.SIGCONT)
        woke_at = time.time()
        code = zombie.wait_exit(60)  # bounded: its next commit or heartbeat is refused
        assert code == EX_SUPERSEDED, f"the woken zombie exited with {code}\n{zombie.tail()}"
        assert "was replaced" in zombie.tail(), zombie.tail()
        # A zombie frozen past its liveness timeout is ended by its watchdog on waking (exit
        # 1 or 75) and restarted on its host: the restart must not take the id back from the
        # live successor (bounded: a session timeout and a margin, then it stops).
        zombie.start()
        code = zombie.wait_exit(90)
        assert code == EX_SUPERSEDED, f"the zombie's restart exited with {code}\n{zombie.tail()}"
        assert "took it over" in zombie.tail(), zombie.tail()
        producer.join()
        job.workers.append(successor)  # caught up and stopped with the job
        job.wait_until_caught_up()
        job.verify()
        after_wake = [e for e in read_events(successor.metrics_path) if e["time"] > woke_at]
        assert any(e["event"] == "checkpoint" for e in after_wake), successor.tail()
        disturbed = [
            e for e in after_wake if e["event"] in ("checkpoint_failed", "consumer_replaced")
        ]
        assert not disturbed, f"the zombie disturbed its successor: {disturbed}\n" + (
            successor.tail()
        )
        assert "replacing it" not in successor.tail(200), successor.tail()
    finally:
        successor.kill()
    job.stop_all()


def test_a_worker_fenced_by_a_process_of_its_id_that_died_at_start_goes_on(
    job_factory, tmp_path: Path
) -> None:
    """A second process with w0's id starts on another host (a mistaken deployment, a
    replacement the orchestrator killed at once): it leaves its mark as the id's newest
    incarnation and fences w0's producer with init_transactions, then dies before it joins
    the group. w0 must not stop (exit 79) with nobody left to run the id: it waits a
    session timeout and a margin for that process to join, takes the id back, and goes on
    committing; every order's effect is there exactly once."""
    from confluent_kafka import Producer

    from snapline.pipeline.checkpoint.storage import CheckpointStorage
    from snapline.pipeline.runtime import departed, incarnation

    job = job_factory(interval=0.5, workers=1)
    (worker,) = job.workers
    worker.start()
    job.produce(5_000)
    started = time.time()
    deadline = time.monotonic() + 90  # bounded: the worker commits within seconds
    while not any(
        e["event"] == "checkpoint" and e["time"] > started for e in read_events(worker.metrics_path)
    ):
        assert time.monotonic() < deadline, "the worker never committed\n" + job.logs()
        time.sleep(0.2)
    storage = CheckpointStorage(str(job.workdir / "checkpoints"))
    dead = incarnation.register(
        storage, job.name, worker.worker_id, tmp_path / "host2" / "mark", lambda: None, 0.0
    )
    fencer = Producer(
        {
            "bootstrap.servers": job.bootstrap,
            "transactional.id": departed.transactional_id(job.name, worker.worker_id),
        }
    )
    fencer.init_transactions(30)
    del fencer  # it dies here, never a member of the group
    fenced_at = time.time()
    producer = job.produce_in_background(20_000, waves=20)  # the fence meets a commit
    # Bounded: the worker's next commit is refused at once; it then waits a session timeout
    # (10 s) + STOP_BOUND (30 s) + 5 s for the dead process to join, and restores.
    deadline = time.monotonic() + 150
    while not any(
        e["event"] == "checkpoint" and e["time"] > fenced_at + 40
        for e in read_events(worker.metrics_path)
    ):
        assert worker.alive, f"w0 exited with {worker.proc.poll()}\n{worker.tail()}"
        assert time.monotonic() < deadline, "w0 never committed again\n" + worker.tail()
        time.sleep(0.5)
    log = worker.tail(400)
    assert "waiting up to" in log and "taken for dead" in log, log
    assert incarnation.read(storage, job.name, worker.worker_id).token != dead.token
    producer.join()
    job.wait_until_caught_up()
    job.verify()
    assert worker.alive, worker.tail()
    job.stop_all()


def test_materialization_runs_while_processing_continues(job_factory) -> None:
    """Slow checkpoint storage (each write sleeps 1.5 s): records keep being read and
    processed while the snapshot is written; the output is still exactly once."""
    job = job_factory(
        interval=0.3, workers=1, extra_env={"SNAPLINE_TEST_STORAGE_WRITE_DELAY": "1.5"}
    )
    job.workers[0].start()
    producer = job.produce_in_background(60_000, waves=30)
    producer.join()
    job.wait_until_caught_up(timeout=240)
    job.verify()
    job.stop_all()
    checkpoints = [
        e for e in read_events(job.workers[0].metrics_path) if e.get("event") == "checkpoint"
    ]
    assert checkpoints
    slow = [c for c in checkpoints if c["materialize_ms"] >= 1500]
    assert slow, f"storage delay not visible: {checkpoints[:3]}"
    overlapped = [c for c in slow if c["records_during_checkpoint"] > 0]
    assert overlapped, (
        "no records were processed while a snapshot was being written: " + json.dumps(slow[:5])
    )
