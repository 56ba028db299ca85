"""Broker bounces under live workers: the broker is SIGKILLed, stopped cleanly, crashed twice
in a row and kept down longer than the transaction timeout, while 2 workers of the warehouse
pipeline (Kafka + Parquet + PostgreSQL) process input and are themselves SIGKILLed now and
then. Workers that live through an outage must commit again by themselves; independent
readers (a read_committed consumer, pyarrow on the table, SQL on the database) must find
every input exactly once.

The test plays the supervisor: a worker that exits by itself is restarted, and only exit code
75 (EX_TEMPFAIL, "Kafka client cannot go on, restart me") is accepted. It prints the time from
broker-back to each surviving worker's first commit (p50, max).
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import struct
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from examples.orders import produce_orders, read_committed, verify_totals
from examples.workers import WorkerProcess, read_events
from integration_tests.warehouse_job import WarehouseJob
from snapline.connectors.local.broker import LocalKafkaBroker
from snapline.pipeline.runtime.kafka_calls import EX_TEMPFAIL

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.slow]

PARTITIONS = 4
CUSTOMERS = 500
TRANSACTION_TIMEOUT_S = 10
#: How long a worker that lived through an outage may take to commit again.
RECOMMIT_DEADLINE = 120.0
STOP_BOUND = 30.0

# (kind, seconds down, what happens to worker w0 during the outage). Kinds: "kill" = SIGKILL
# of the broker JVM; "stop" = clean shutdown; "double" = SIGKILL, restart, SIGKILL again as
# soon as it serves, restart; "long" = SIGKILL and down for twice the transaction timeout.
# w0 during the outage: "term" = SIGTERM (must end within STOP_BOUND), "kill" = SIGKILL and
# restart while the broker is still down. w1 always lives through the outage.
SCHEDULE = [
    ("kill", 2.0, None),
    ("stop", 1.0, None),
    ("double", 1.0, None),
    ("kill", 3.0, "kill"),
    ("long", TRANSACTION_TIMEOUT_S * 2.0, "term"),
    ("stop", 1.0, None),
    ("double", 1.0, None),
    ("kill", 1.0, None),
    ("stop", 2.0, "kill"),
    ("kill", 1.0, None),
]


@dataclass
class Outage:
    kind: str
    down_at: float
    back_at: float = 0.0
    #: worker id -> pid of the worker process alive through the whole outage
    survivors: dict[str, int] = field(default_factory=dict)


class Cluster:
    """The test's own broker: kept data dir, same port across restarts."""

    def __init__(self, data_dir: Path) -> None:
        # A crashed KRaft node cannot register again until the controller timed out its
        # previous session (broker.session.timeout.ms, 9 s by default): 3 s keeps restarts
        # after a SIGKILL short, so the test fits CI. It changes nothing for the workers.
        self.broker = LocalKafkaBroker(
            data_dir=data_dir,
            server_overrides={
                "broker.session.timeout.ms": "3000",
                "broker.heartbeat.interval.ms": "1000",
            },
        )
        self.start_seconds: list[float] = []
        self.bootstrap = self.broker.start()

    def crash(self) -> None:
        pid = self.broker.pid
        assert pid is not None and self.broker.running
        os.kill(pid, signal.SIGKILL)
        assert self.broker.wait(30) is not None, "the broker JVM survived SIGKILL"

    def stop(self) -> None:
        self.broker.stop()

    def start(self) -> float:
        started = time.monotonic()
        assert self.broker.start() == self.bootstrap, "the broker came back on another port"
        self.start_seconds.append(time.monotonic() - started)
        return time.time()

    @property
    def log_dirs(self) -> Path:
        return self.broker.data_dir / "kraft-logs"


class BounceJob(WarehouseJob):
    """The warehouse job with input flowing through outages, and the supervisor's part."""

    def __init__(self, bootstrap: str, name: str, workdir: Path, dsn: str) -> None:
        super().__init__(
            bootstrap,
            name,
            workdir,
            dsn,
            partitions=PARTITIONS,
            customers=CUSTOMERS,
            extra_env={"SNAPLINE_EXAMPLE_TXN_TIMEOUT_MS": str(TRANSACTION_TIMEOUT_S * 1000)},
        )
        self.by_id = {w.worker_id: w for w in self.workers}
        self.metrics = workdir / "metrics.jsonl"
        #: (worker id, exit code) of every exit the test did not cause
        self.self_exits: list[tuple[str, int | None]] = []
        self._produce_lock = threading.Lock()
        self._input_stop = threading.Event()
        self._input: threading.Thread | None = None
        self.input_errors: list[str] = []

    def produce(self, count: int) -> None:
        # Idempotent: the producer's retries across a broker restart write each order once.
        with self._produce_lock:
            totals = produce_orders(
                self.bootstrap,
                self.orders_topic,
                count,
                self.customers,
                start_id=self.produced,
                producer_config={"enable.idempotence": True},
            )
            for customer, amount in totals.items():
                self.expected[customer] = self.expected.get(customer, 0) + amount
            self.produced += count

    def start_input(self, batch: int = 200, pause: float = 0.25) -> None:
        """Input keeps flowing, outages included (delivery waits for the broker)."""

        def run() -> None:
            while not self._input_stop.is_set():
                try:
                    self.produce(batch)
                except Exception as exc:  # reported by the test
                    self.input_errors.append(repr(exc))
                    return
                self._input_stop.wait(pause)

        self._input = threading.Thread(target=run, name="input", daemon=True)
        self._input.start()

    def stop_input(self) -> None:
        self._input_stop.set()
        if self._input is not None:
            self._input.join(90)
            assert not self._input.is_alive(), "the input thread did not finish"
        assert not self.input_errors, f"producing the input failed: {self.input_errors}"

    def supervise(self) -> None:
        """Restart workers that exited by themselves (what the supervisor does)."""
        for worker in self.workers:
            if worker.proc is not None and not worker.alive:
                self.self_exits.append((worker.worker_id, worker.proc.returncode))
                worker.start()

    def pids(self) -> dict[str, int]:
        return {w.worker_id: w.proc.pid for w in self.workers if w.alive and w.proc is not None}

    def commits_after(self, since: float) -> dict[int, float]:
        """pid -> time of its first checkpoint committed after ``since``."""
        first: dict[int, float] = {}
        for e in read_events(self.metrics):
            if e.get("event") == "checkpoint" and e["time"] > since:
                first.setdefault(e["pid"], e["time"])
        return first

    def logs(self) -> str:
        return "\n".join(f"--- {w.worker_id}\n{w.tail(60)}" for w in self.workers)


def _wait_for_recommits(job: BounceJob, outage: Outage) -> dict[str, float]:
    """Until every worker that lived through ``outage`` committed again in the same process.

    Returns worker id -> seconds from broker-back to that commit. A survivor that exited by
    itself meanwhile (exit 75) is reported and dropped; it did not ride the outage out."""
    deadline = time.monotonic() + RECOMMIT_DEADLINE
    waiting = dict(outage.survivors)
    delays: dict[str, float] = {}
    while waiting:
        job.supervise()
        first = job.commits_after(outage.back_at)
        for worker_id, pid in list(waiting.items()):
            if pid in first:
                delays[worker_id] = first[pid] - outage.back_at
                del waiting[worker_id]
            elif job.pids().get(worker_id) != pid:
                del waiting[worker_id]  # exited by itself: recorded in job.self_exits
        if waiting and time.monotonic() > deadline:
            raise AssertionError(
                f"after the {outage.kind} outage, workers {sorted(waiting)} lived through it "
                f"but did not commit within {RECOMMIT_DEADLINE:.0f}s of the broker's return\n"
                + job.logs()
            )
        if waiting:
            time.sleep(0.5)
    return delays


def _stop_within_bound(worker: WorkerProcess) -> float:
    started = time.monotonic()
    code = worker.stop(timeout=STOP_BOUND + 15)
    took = time.monotonic() - started
    assert code is not None and took <= STOP_BOUND, (
        f"SIGTERM during an outage: worker {worker.worker_id} took {took:.1f}s (exit {code}), "
        f"bound {STOP_BOUND:.0f}s\n{worker.tail(60)}"
    )
    return took


# --------------------------------------------------------------------------- the marker fault


def _read_batches(log_dir: Path) -> list[dict[str, Any]]:
    """Record batches of one partition read straight from its segment files (format v2):
    offsets, producer id/epoch, transactional and control flags, and a control batch's marker
    (0 = ABORT, 1 = COMMIT). An independent reader of what the broker actually wrote."""
    batches = []
    for segment in sorted(log_dir.glob("*.log")):
        data = segment.read_bytes()
        pos = 0
        while pos + 61 <= len(data):
            base_offset, length = struct.unpack_from(">qi", data, pos)
            if length <= 0 or pos + 12 + length > len(data):
                break
            attributes, last_delta = struct.unpack_from(">hi", data, pos + 21)
            producer_id, producer_epoch = struct.unpack_from(">qh", data, pos + 43)
            batch = {
                "first": base_offset,
                "last": base_offset + last_delta,
                "pid": producer_id,
                "epoch": producer_epoch,
                "transactional": bool(attributes & 0x10),
                "control": bool(attributes & 0x20),
                "marker": None,
            }
            if batch["control"]:
                # first record: length, attributes, timestamp delta, offset delta, key length
                # (varints), then the key: version int16, type int16
                rec = pos + 61
                for _ in range(5):
                    if _ == 1:
                        rec += 1  # attributes: one byte
                        continue
                    while data[rec] & 0x80:
                        rec += 1
                    rec += 1
                batch["marker"] = struct.unpack_from(">hh", data, rec)[1]
            batches.append(batch)
            pos += 12 + length
    return batches


def _orphaned(batches: list[dict[str, Any]], offset: int) -> bool:
    """The record at ``offset`` belongs to a transaction that no marker ended, made visible by
    a later epoch's COMMIT: after its batch, the same producer id wrote data with a higher
    epoch before any marker, and the first marker after that is a COMMIT. This is the issue 9
    item 3 signature (the abort of a killed worker's transaction was interrupted by a second
    broker crash and the broker skipped the ABORT markers). A normal transaction is followed
    by its own marker before any data of a later epoch."""
    batch = next(b for b in batches if b["first"] <= offset <= b["last"])
    if not batch["transactional"] or batch["control"]:
        return False
    later_epoch_data = False
    for later in batches:
        if later["first"] <= batch["last"] or later["pid"] != batch["pid"]:
            continue
        if later["control"]:
            return later_epoch_data and later["marker"] == 1  # COMMIT
        if later["epoch"] > batch["epoch"]:
            later_epoch_data = True
    return False


def _copies(bootstrap: str, topic: str, order_ids: set[int]) -> dict[int, list[tuple[int, int]]]:
    """(partition, offset) of every committed copy of ``order_ids`` in ``topic``."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"copies-{time.time_ns()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
        }
    )
    found: dict[int, list[tuple[int, int]]] = defaultdict(list)
    try:
        tps = [TopicPartition(topic, p, 0) for p in range(PARTITIONS)]
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in tps}
        consumer.assign(tps)
        done: set[int] = {p for p, end in ends.items() if end == 0}
        deadline = time.monotonic() + 120
        quiet_since = time.monotonic()
        # until every partition is read to its end, or nothing arrived for 10 s (a position
        # can stay short of the high watermark, which counts the last control marker)
        while len(done) < PARTITIONS and time.monotonic() < deadline:
            batch = consumer.consume(5000, 0.5)
            if batch:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > 10:
                break
            for msg in batch:
                if msg.error() is not None:
                    continue
                order = orjson.loads(msg.value())["order_id"]
                if order in order_ids:
                    found[order].append((msg.partition(), msg.offset()))
            for p, end in ends.items():
                position = consumer.position([TopicPartition(topic, p)])[0].offset
                if position >= end or position < 0 and end == 0:
                    done.add(p)
    finally:
        consumer.close()
    return found


def _known_marker_fault(cluster: Cluster, job: BounceJob, duplicates: list[int]) -> str | None:
    """A report if every Kafka duplicate is one committed copy plus orphaned copies (see
    ``_orphaned``); None if any duplicate has another explanation."""
    copies = _copies(job.bootstrap, job.totals_topic, set(duplicates))
    batches = {
        p: _read_batches(cluster.log_dirs / f"{job.totals_topic}-{p}") for p in range(PARTITIONS)
    }
    orphans = 0
    for order in duplicates:
        kinds = [_orphaned(batches[p], off) for p, off in copies.get(order, [])]
        if kinds.count(False) != 1:
            return None
        orphans += kinds.count(True)
    skipped = (
        "likely deleted already and hence can be skipped"
        in cluster.broker.log_path.read_text(errors="replace")
    )
    return (
        f"{len(duplicates)} inputs appear twice in Kafka only; each extra copy ({orphans} in "
        "all) lies in a transaction that no marker of its own epoch ended and a later epoch's "
        "COMMIT made visible (issue 9 item 3, broker skipped ABORT markers"
        + ("; the broker logged skipping markers" if skipped else "")
        + ")"
    )


# --------------------------------------------------------------------------- the test


def test_workers_ride_out_broker_bounces(
    postgres_dsn: str, tmp_path: Path, unique_name: str
) -> None:
    cluster = Cluster(tmp_path / "kafka")
    try:
        job = BounceJob(cluster.bootstrap, unique_name, tmp_path, postgres_dsn)
        rng = random.Random(9)
        outages: list[Outage] = []
        delays: list[float] = []
        test_kills = 0
        stop_times: list[float] = []
        try:
            for worker in job.workers:
                worker.start()
            job.produce(3000)
            job.start_input()
            start = Outage("start", down_at=time.time(), back_at=time.time(), survivors=job.pids())
            _wait_for_recommits(job, start)

            for kind, down, w0_action in SCHEDULE:
                job.supervise()
                if rng.random() < 0.4:  # a worker dies now and then, independent of the broker
                    victim = rng.choice(job.workers)
                    victim.kill()
                    test_kills += 1
                    victim.start()
                time.sleep(rng.uniform(0.5, 2.0))
                job.produce(2000)  # a burst the workers are still processing when it goes
                outage = Outage(kind, down_at=time.time())
                survivors_before = job.pids()
                if kind == "stop":
                    cluster.stop()
                else:
                    cluster.crash()
                if kind == "double":
                    cluster.start()
                    cluster.crash()
                w0 = job.by_id["w0"]
                if w0_action is not None:
                    time.sleep(1)
                    survivors_before.pop("w0", None)
                    if w0_action == "term":
                        stop_times.append(_stop_within_bound(w0))
                    else:
                        w0.kill()
                        test_kills += 1
                        w0.start()
                time.sleep(max(0.0, down - (time.time() - outage.down_at)))
                outage.back_at = cluster.start()
                if w0_action == "term":
                    w0.start()
                outage.survivors = {
                    w: pid for w, pid in survivors_before.items() if job.pids().get(w) == pid
                }
                outages.append(outage)
                recommits = _wait_for_recommits(job, outage)
                delays.extend(recommits.values())
                assert recommits, (
                    f"after the {kind} outage no worker that lived through it committed again "
                    f"in the same process (exits by themselves: {job.self_exits})\n" + job.logs()
                )
                print(
                    f"{kind} outage ({outage.back_at - outage.down_at:.1f}s down, broker start "
                    f"{cluster.start_seconds[-1]:.1f}s): first commit "
                    f"after broker-back { ({w: round(d, 1) for w, d in recommits.items()}) }"
                )

            job.stop_input()
            job.supervise()
            job.wait_until_caught_up()
            job.supervise()
            outputs = read_committed(
                job.bootstrap, job.totals_topic, job.produced, timeout=120, settle=3
            )
            job.verify_table_and_database()  # Parquet with pyarrow, PostgreSQL with SQL
            job.stop_all()
        finally:
            job._input_stop.set()
            for worker in job.workers:
                worker.kill()

        # Kafka, read_committed: every input exactly once
        check = verify_totals(outputs, job.expected, range(job.produced))
        exits = Counter(code for _, code in job.self_exits)
        p50 = statistics.median(delays)
        print(
            f"\nbroker bounces: {len(outages)} ({Counter(o.kind for o in outages)}), inputs "
            f"{job.produced}, worker SIGKILLs by the test {test_kills}, exits by themselves "
            f"{dict(exits)}, SIGTERM during an outage took {[round(t, 1) for t in stop_times]}s\n"
            f"broker-back to first commit of a surviving worker: p50 {p50:.1f}s, max "
            f"{max(delays):.1f}s over {len(delays)} recoveries"
        )
        bad_exits = {code for code in exits if code != EX_TEMPFAIL}
        assert not bad_exits, f"workers exited by themselves with {job.self_exits}\n{job.logs()}"
        assert len(outages) >= 10 and test_kills >= 2
        if not check.ok:
            only_duplicates = not (check.missing or check.wrong_totals)
            known = _known_marker_fault(cluster, job, check.duplicates) if only_duplicates else None
            if known is None:
                pytest.fail("Kafka: " + check.summary() + "\n" + job.logs())
            pytest.xfail("KNOWN RESIDUAL RISK: " + known)
    finally:
        cluster.stop()
