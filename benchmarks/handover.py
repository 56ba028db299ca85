"""``python -m benchmarks handover``: how long the partitions of a Snapline worker that died for
good take to produce committed output again, on the worker that survives.

Per repetition: produce one record per key (``--keys``, ~150 B of state each), start two
workers of one job (``snapline run ... --worker-id 0`` and ``--worker-id 1``, rocksdb, one
checkpoint directory), wait until every output is committed, then produce a steady
``--rate`` of records for existing keys, SIGKILL worker 1 after ``--warmup`` seconds and
never restart it. An independent read_committed consumer times, per input partition, the
outputs it sees; a partition worker 1 owned (asked of the group coordinator before the kill)
is handed over when its first output produced by the survivor is visible. At the end the
output must be the effect of every input exactly once.

Where the time goes comes from the survivor's events (``SNAPLINE_METRICS_FILE``): the kill →
``revoked`` (the coordinator expires the dead member's session, ``session.timeout.ms``, and
the survivor learns of the rebalance at its next heartbeat); → ``assigned`` (the survivor's
revoke checkpoint, rejoin); → ``restored`` (its tasks and the dead worker's, from checkpoint
storage); → the first checkpoint's commit; → the verifier sees the output. The dead worker's
last transaction stays open until the broker aborts it (``transaction.timeout.ms`` after it
began, checked every 10 s); until then a read_committed reader cannot read past it, on every
output partition it wrote to.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from rich.console import Console
from rich.table import Table

from benchmarks import report
from benchmarks.child_env import ChildEnv
from benchmarks.kafka_admin import Topics
from benchmarks.process import Child
from benchmarks.snapline_pipelines import KAFKA_CONFIG_ENV
from benchmarks.snapline_runs import METRICS_ENV, runtime_missing
from benchmarks.verifier import Verifier, check
from benchmarks.workload import RateProducer, each_key_once, prepare_input
from examples.workers import read_events

#: Input record size that gives ~150 B of JSON state per key (as in the recovery benchmark).
STATE_RECORD_BYTES = 194
#: Snapline's consumer defaults (snapline/pipeline/runtime/worker.py ``_consumer_config``) and
#: its producer's (``runtime/transaction.py``); ``--kafka-config`` overrides them.
SESSION_TIMEOUT_MS = 10_000
TRANSACTION_TIMEOUT_MS = 60_000
KILLED, SURVIVOR = "1", "0"


@dataclass(frozen=True)
class HandoverConfig:
    keys: int
    partitions: int
    repetitions: int
    rate: float
    warmup_s: float
    #: input keeps flowing this long after the kill
    after_kill_s: float
    #: extra librdkafka settings of both workers
    kafka_config: dict[str, str]
    output: Path | None
    command: str
    quick: bool = False


@dataclass
class HandoverResult:
    repetition: int
    status: str = "ok"
    problems: list[str] = field(default_factory=list)
    load_start: tuple[float, ...] = ()
    load_end: tuple[float, ...] = ()
    dead_partitions: list[int] = field(default_factory=list)
    survivor_partitions: list[int] = field(default_factory=list)
    kill_at: float | None = None
    #: kill → first output of a partition the dead worker owned, seen by the verifier
    first_dead_output_s: float | None = None
    #: kill → every partition the dead worker owned has output again
    all_dead_outputs_s: float | None = None
    #: kill → the survivor's own partitions have output again (an eager rebalance stops them)
    all_survivor_outputs_s: float | None = None
    #: kill → each survivor event: revoked, assigned, restored, first checkpoint committed
    events_s: dict[str, float] = field(default_factory=dict)
    restore_s: float | None = None
    restored_bytes: int | None = None
    revoke_checkpoint_s: float | None = None
    #: kill → the dead worker's last committed checkpoint (negative: before the kill); its
    #: next transaction began then and stays open until the broker aborts it
    dead_last_checkpoint_s: float | None = None
    inputs: int = 0
    outputs: int = 0
    log_dir: str = ""
    log_tail: str = ""

    def fail(self, problem: str) -> None:
        self.status = "FAILED"
        self.problems.append(problem)


def _load() -> tuple[float, ...]:
    return tuple(round(x, 2) for x in os.getloadavg())


class PartitionClock:
    """When the verifier saw outputs, per input partition of the output's key.

    Fed from the verifier's thread; read by the harness thread under the lock."""

    def __init__(self, partition_of: dict[str, int]) -> None:
        self._partition_of = partition_of
        self._lock = threading.Lock()
        self._seen: dict[int, list[float]] = {}
        self.unknown = 0

    def __call__(self, value: bytes | None, seen_at: float) -> None:
        try:
            customer = orjson.loads(value or b"")["customer"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return  # the tally counts it as undecodable
        partition = self._partition_of.get(customer)
        with self._lock:
            if partition is None:
                self.unknown += 1
            else:
                self._seen.setdefault(partition, []).append(seen_at)

    def first_after(self, partition: int, after: float) -> float | None:
        with self._lock:
            return next((t for t in self._seen.get(partition, []) if t > after), None)


def partitions_of_keys(
    bootstrap: str, topic: str, partitions: int, records: int, timeout: float = 120.0
) -> dict[str, int]:
    """Which input partition each key went to: read the first ``records`` records back."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"keys-{topic}",
            "enable.auto.commit": False,
            "enable.partition.eof": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    where: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    read = 0
    try:
        while read < records:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"read back only {read}/{records} input records of {topic} in {timeout:.0f}s"
                )
            for msg in consumer.consume(10_000, 0.5):
                if msg.error() is None:
                    where[msg.key().decode()] = msg.partition()
                    read += 1
    finally:
        consumer.close()
    return where


def group_assignment(bootstrap: str, group: str, timeout: float = 60.0) -> dict[str, list[int]]:
    """The coordinator's assignment, per ``group.instance.id``, once the group is stable with
    two members that own partitions."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            description = admin.describe_consumer_groups([group])[group].result(10)
        except Exception as exc:  # noqa: BLE001 - retried within the bound, reported on timeout
            last = repr(exc)
        else:
            owned = {
                m.group_instance_id or m.member_id: sorted(
                    tp.partition for tp in m.assignment.topic_partitions
                )
                for m in description.members
            }
            last = f"state {description.state}, members {owned}"
            if (
                str(description.state).endswith("STABLE")
                and len(owned) == 2
                and all(owned.values())
            ):
                return owned
        time.sleep(0.5)
    raise RuntimeError(
        f"group {group} did not settle on two members with partitions within "
        f"{timeout:.0f}s ({last})"
    )


class HandoverRun:
    """One repetition: build state on two workers, kill one for good, time the hand-over."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        workdir: Path,
        config: HandoverConfig,
        console: Console,
    ) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.workdir = workdir
        self.config = config
        self.console = console
        self.keep_logs = bool(os.environ.get("BENCH_KEEP_WORKDIR"))
        session_ms = int(config.kafka_config.get("session.timeout.ms", SESSION_TIMEOUT_MS))
        txn_ms = int(config.kafka_config.get("transaction.timeout.ms", TRANSACTION_TIMEOUT_MS))
        # the survivor's output can be unreadable until the dead transaction is aborted:
        # its timeout plus the broker's 10 s abort check, plus a restore and checkpoint
        self.handover_timeout = (max(session_ms, txn_ms) + 10_000) / 1000 + 60.0

    def run(self, repetition: int, prefix: str) -> HandoverResult:
        cfg = self.config
        result = HandoverResult(repetition=repetition, load_start=_load())
        job = f"{prefix}-r{repetition}"
        rundir = self.workdir / job
        rundir.mkdir(parents=True)
        result.log_dir = str(rundir)
        in_topic = self.topics.create(f"{job}-in", cfg.partitions)
        out_topic = self.topics.create(f"{job}-out", cfg.partitions)
        expected = prepare_input(
            self.bootstrap, in_topic, each_key_once(cfg.keys), STATE_RECORD_BYTES, random_notes=True
        )
        clock = PartitionClock(
            partitions_of_keys(self.bootstrap, in_topic, cfg.partitions, cfg.keys)
        )
        verifier = Verifier(self.bootstrap, out_topic, cfg.partitions, "total", on_output=clock)
        env = ChildEnv(
            bootstrap=self.bootstrap,
            in_topic=in_topic,
            out_topic=out_topic,
            group=job,
            start_file=str(rundir / "started"),
            stats_file=str(rundir / "stats.json"),
            state_dir=str(rundir / "state"),
            backend="rocksdb",
            guarantee="exactly_once",
        )
        workers: dict[str, Child] = {}
        producer: RateProducer | None = None
        try:
            for worker_id in (SURVIVOR, KILLED):
                workers[worker_id] = self._launch(worker_id, env, rundir)

            def both_running() -> bool:
                return all(w.running() for w in workers.values())

            seen, why = verifier.wait_for(cfg.keys, 120.0 + cfg.keys / 2_000, 120.0, both_running)
            if seen is None:
                result.fail(f"building state on two workers: {why}")
                return self._finish(result, workers, verifier, expected, rundir)
            owned = group_assignment(self.bootstrap, job)
            result.dead_partitions = owned.get(f"{job}-{KILLED}", [])
            result.survivor_partitions = owned.get(f"{job}-{SURVIVOR}", [])
            if not result.dead_partitions or not result.survivor_partitions:
                result.fail(f"unexpected group members {owned}")
                return self._finish(result, workers, verifier, expected, rundir)
            # a steady input for existing keys: continues the build's expected totals
            producer = RateProducer(self.bootstrap, in_topic, cfg.keys)
            producer.ledger.expected = expected
            producer.run_at_rate(cfg.rate, cfg.warmup_s + cfg.after_kill_s)
            time.sleep(cfg.warmup_s)
            survivor = workers[SURVIVOR]
            kill_at = time.time()
            workers[KILLED].kill()
            result.kill_at = kill_at
            self.console.print(
                f"  r{repetition}: worker {KILLED} (partitions "
                f"{result.dead_partitions}) SIGKILLed; waiting for worker "
                f"{SURVIVOR} to take them over"
            )
            taken = self._wait_handover(result, survivor, clock, rundir)
            if taken:
                self._split(result, rundir)
            if not producer.join(cfg.warmup_s + cfg.after_kill_s + 60.0):
                result.fail("the rate producer did not finish within its duration + 60 s")
            producer.close()
            inputs = expected.count
            seen, why = verifier.wait_for(
                inputs, self.handover_timeout + 60.0, self.handover_timeout, survivor.running
            )
            if seen is None:
                result.fail(f"after the hand-over: {why}")
            return self._finish(result, workers, verifier, expected, rundir)
        finally:
            if producer is not None:
                producer.close()
            for w in workers.values():
                if w.running():
                    w.kill()
            verifier.stop()
            self.topics.delete([in_topic, out_topic])
            self.topics.delete_containing(job)
            if not self.keep_logs and result.status == "ok":
                shutil.rmtree(rundir, ignore_errors=True)

    def _launch(self, worker_id: str, env: ChildEnv, rundir: Path) -> Child:
        argv = [
            sys.executable,
            "-m",
            "benchmarks.snapline_entry",
            "run",
            "benchmarks.snapline_pipelines:running_total_with_note",
            "--bootstrap-servers",
            self.bootstrap,
            "--worker-id",
            worker_id,
        ]
        return Child(
            argv,
            {
                **env.to_environ(),
                METRICS_ENV: str(rundir / f"metrics-{worker_id}.jsonl"),
                KAFKA_CONFIG_ENV: json.dumps(self.config.kafka_config),
            },
            rundir / f"worker-{worker_id}.log",
        )

    def _survivor_assigned(self, rundir: Path, after: float) -> float | None:
        """When the survivor was assigned every partition, after ``after``."""
        for e in read_events(rundir / f"metrics-{SURVIVOR}.jsonl"):
            if (
                e.get("event") == "assigned"
                and float(e["time"]) > after
                and e.get("partitions") == self.config.partitions
            ):
                return float(e["time"])
        return None

    def _wait_handover(
        self, result: HandoverResult, survivor: Child, clock: PartitionClock, rundir: Path
    ) -> bool:
        """Wait until every partition of the dead worker has output produced by the survivor
        (seen after the survivor was assigned them: the dead worker cannot commit any more,
        and what it committed before the kill was seen within ~0.1 s of the commit)."""
        assert result.kill_at is not None
        deadline = time.monotonic() + self.handover_timeout
        while time.monotonic() < deadline:
            if not survivor.running():
                result.fail("the surviving worker exited during the hand-over")
                return False
            assigned = self._survivor_assigned(rundir, result.kill_at)
            if assigned is not None:
                dead = [clock.first_after(p, assigned) for p in result.dead_partitions]
                own = [clock.first_after(p, assigned) for p in result.survivor_partitions]
                if all(t is not None for t in dead + own):
                    firsts = [t for t in dead if t is not None]
                    result.first_dead_output_s = round(min(firsts) - result.kill_at, 3)
                    result.all_dead_outputs_s = round(max(firsts) - result.kill_at, 3)
                    result.all_survivor_outputs_s = round(
                        max(t for t in own if t is not None) - result.kill_at, 3
                    )
                    return True
            time.sleep(0.1)
        result.fail(
            f"the dead worker's partitions {result.dead_partitions} had no new output "
            f"within {self.handover_timeout:.0f}s of the kill (survivor assigned: "
            f"{self._survivor_assigned(rundir, result.kill_at)})"
        )
        return False

    def _split(self, result: HandoverResult, rundir: Path) -> None:
        """The survivor's events after the kill, as seconds since the kill."""
        assert result.kill_at is not None
        kill_at = result.kill_at
        events = [
            e
            for e in read_events(rundir / f"metrics-{SURVIVOR}.jsonl")
            if float(e.get("time", 0)) > kill_at
        ]
        at: dict[str, float] = {}
        for e in events:
            kind = str(e.get("event"))
            if kind in ("revoked", "lost") and "revoked" not in at:
                at["revoked"] = float(e["time"])
                if kind == "lost":
                    result.problems.append("the survivor lost its partitions (no revoke)")
            elif kind == "revoke_checkpoint" and result.revoke_checkpoint_s is None:
                result.revoke_checkpoint_s = float(e.get("seconds", 0.0))
            elif (
                kind == "assigned"
                and "revoked" in at
                and "assigned" not in at
                and e.get("partitions") == self.config.partitions
            ):
                at["assigned"] = float(e["time"])
            elif kind == "restored" and "assigned" in at and "restored" not in at:
                at["restored"] = float(e["time"])
                result.restore_s = float(e.get("seconds", 0.0))
                result.restored_bytes = e.get("bytes")
            elif kind == "checkpoint" and "restored" in at and "first checkpoint" not in at:
                at["first checkpoint"] = float(e["time"])
        result.events_s = {k: round(v - kill_at, 3) for k, v in at.items()}
        dead_checkpoints = [
            float(e["time"])
            for e in read_events(rundir / f"metrics-{KILLED}.jsonl")
            if e.get("event") == "checkpoint" and float(e["time"]) <= kill_at
        ]
        if dead_checkpoints:
            result.dead_last_checkpoint_s = round(max(dead_checkpoints) - kill_at, 3)

    def _finish(
        self,
        result: HandoverResult,
        workers: dict[str, Child],
        verifier: Verifier,
        expected: Any,
        rundir: Path,
    ) -> HandoverResult:
        result.load_end = _load()
        tails = []
        for worker_id, w in workers.items():
            exit_ = w.stop(30.0)
            if worker_id == SURVIVOR and exit_.stopped_by != "SIGTERM":
                result.fail(
                    f"the survivor ended by {exit_.stopped_by} with "
                    f"{exit_.returncode}, not by the harness's SIGTERM"
                )
            tails.append(f"--- worker {worker_id}\n{exit_.log_tail}")
        verifier.drain()
        result.inputs = expected.count
        result.outputs = verifier.count
        if result.status == "ok":
            for problem in check(verifier.tally, expected, exactly_once=True):
                result.fail("wrong output: " + problem)
        if result.status != "ok":
            result.log_tail = "\n".join(tails)
        return result


def _summary(results: list[HandoverResult]) -> dict[str, Any]:
    ok = [r for r in results if r.status == "ok" and r.all_dead_outputs_s is not None]

    def stat(values: list[float]) -> dict[str, float]:
        return (
            {"p50": round(statistics.median(values), 3), "max": round(max(values), 3)}
            if values
            else {}
        )

    summary: dict[str, Any] = {
        "first_dead_output_s": stat(
            [r.first_dead_output_s for r in ok if r.first_dead_output_s is not None]
        ),
        "all_dead_outputs_s": stat(
            [r.all_dead_outputs_s for r in ok if r.all_dead_outputs_s is not None]
        ),
        "all_survivor_outputs_s": stat(
            [r.all_survivor_outputs_s for r in ok if r.all_survivor_outputs_s is not None]
        ),
    }
    for name in ("revoked", "assigned", "restored", "first checkpoint"):
        summary[f"kill → {name}"] = stat([r.events_s[name] for r in ok if name in r.events_s])
    return summary


COLUMNS = (
    "rep",
    "dead partitions",
    "→ revoked",
    "→ assigned",
    "→ restored",
    "→ 1st checkpoint",
    "→ 1st dead output",
    "→ all dead outputs",
    "→ all survivor outputs",
    "dead txn began",
    "load",
    "exactly once",
)


def _row(r: HandoverResult) -> tuple[str, ...]:
    def s(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f} s"

    return (
        str(r.repetition),
        ",".join(map(str, r.dead_partitions)),
        s(r.events_s.get("revoked")),
        s(r.events_s.get("assigned")),
        s(r.events_s.get("restored")),
        s(r.events_s.get("first checkpoint")),
        s(r.first_dead_output_s),
        s(r.all_dead_outputs_s),
        s(r.all_survivor_outputs_s),
        s(r.dead_last_checkpoint_s),
        " ".join(f"{x:.1f}" for x in r.load_end),
        "ok" if r.status == "ok" else r.status,
    )


def run_handover(config: HandoverConfig, bootstrap: str, console: Console) -> dict[str, Any]:
    missing = runtime_missing()
    if missing:
        raise RuntimeError(missing)
    prefix = f"ho-{datetime.now(UTC):%m%d%H%M%S}-{secrets.token_hex(2)}"
    workdir = Path(tempfile.mkdtemp(prefix="snapline-handover-"))
    topics = Topics(bootstrap)
    runner = HandoverRun(bootstrap, topics, workdir, config, console)
    m = report.machine()
    console.print(
        f"[bold]machine[/bold]: {m.description}\n[bold]broker[/bold]: {bootstrap}\n"
        f"kafka config of the workers: {config.kafka_config or 'Snapline defaults'}"
    )
    results: list[HandoverResult] = []
    for repetition in range(1, config.repetitions + 1):
        result = runner.run(repetition, prefix)
        results.append(result)
        if result.status == "ok":
            console.print(
                f"  r{repetition}: dead partitions' first output "
                f"{result.first_dead_output_s} s, all {result.all_dead_outputs_s} s "
                f"after the kill; survivor events {result.events_s}"
            )
        else:
            console.print(
                f"  [red]r{repetition} {result.status}[/red]: "
                f"{'; '.join(result.problems)} (logs: {result.log_dir})"
            )
    if not runner.keep_logs and all(r.status == "ok" for r in results):
        shutil.rmtree(workdir, ignore_errors=True)
    table = Table(
        title=f"hand-over of a dead worker's partitions (seconds after the SIGKILL), "
        f"{config.keys:,} keys — {m.description}"
    )
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "rep" else "right")
    for r in results:
        table.add_row(*_row(r))
    console.print(table)
    summary = _summary(results)
    console.print(f"summary (p50 / max over the repetitions): {summary}")
    payload = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": asdict(m) | {"short": m.short, "description": m.description},
        "command": config.command,
        "config": asdict(config) | {"output": str(config.output or "")},
        "session_timeout_ms": int(
            config.kafka_config.get("session.timeout.ms", SESSION_TIMEOUT_MS)
        ),
        "transaction_timeout_ms": int(
            config.kafka_config.get("transaction.timeout.ms", TRANSACTION_TIMEOUT_MS)
        ),
        "definition": "seconds from the SIGKILL of worker 1 to the first output (of a partition "
        "it owned) that the survivor produced, seen by a read_committed consumer",
        "summary": summary,
        "results": [asdict(r) for r in results],
    }
    path = config.output or report.results_path(m, config.quick, "-handover")
    report.write_results(path, payload)
    console.print(f"results: {path}")
    return payload
