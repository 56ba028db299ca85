"""One measured run of one system: throughput on the shared input, or latency at a fixed rate.

Definitions (measured from outside the system):
- start: wall-clock time at which the system handed its first input record to its processing
  code (the system's process writes it to a file; see ``child_env.StartMarker``);
- end: wall-clock time at which the read_committed verifier first saw the N-th output, i.e.
  an upper bound on the commit time of the last output (the verifier polls every ~10 ms);
- records/s = N / (end - start): process start, group join and state restore are excluded
  (reported separately as ``startup_s``);
- latency: the verifier's time of seeing an output minus the produce time of its input, for
  inputs produced at a fixed rate after a warm-up.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.child_env import ChildEnv, read_start_time, read_stats
from benchmarks.kafka_admin import Topics
from benchmarks.process import (
    Child,
    Exit,
    machine_cpu,
    tree_cpu_seconds,
    tree_main_waits,
    tree_thread_cpu,
)
from benchmarks.profiling import render
from benchmarks.snapline_runs import METRICS_ENV, checkpoint_metrics
from benchmarks.stats import percentile, summarize
from benchmarks.systems import System
from benchmarks.verifier import Verifier, check
from benchmarks.workload import Expected, KeyedBy, LatencyLedger, RateProducer


@dataclass(frozen=True)
class Settings:
    """How long and how hard to measure."""

    partitions: int = 8
    commit_interval: float = 1.0
    startup_timeout: float = 120.0
    stall_timeout: float = 60.0
    min_rate: float = 500.0  # records/s below which a run is called hung
    stop_grace: float = 30.0
    latency_rate: float = 5000.0
    latency_seconds: float = 10.0
    latency_keys: int = 1000
    keyed_by: KeyedBy = "customer"  # the Kafka key of the input records
    profile_dir: Path | None = None


@dataclass
class RunResult:
    system: str
    kind: str  # throughput | latency
    repetition: int
    status: str = "ok"  # ok | FAILED | SKIPPED
    problems: list[str] = field(default_factory=list)
    records: int = 0
    outputs: int = 0
    records_per_s: float | None = None
    #: Records/s over the span of the outputs' produce times (``verifier.produce_span_rate``):
    #: without the wait for the last commit, which ``records_per_s`` includes. None for a
    #: system whose outputs carry its input's timestamps (Quix Streams).
    steady_records_per_s: float | None = None
    elapsed_s: float | None = None
    startup_s: float | None = None
    wall_s: float | None = None
    latency_s: dict[str, Any] = field(default_factory=dict)
    commit_s: dict[str, Any] = field(default_factory=dict)
    checkpoint_s: dict[str, Any] = field(default_factory=dict)
    state_bytes: int | None = None
    peak_rss_mb: float | None = None
    #: CPU seconds of the system's processes (a supervisor with its workers) between its
    #: first input and its last output, and cores of the whole machine busy on average then
    #: (broker, verifier and the system together; at the core count the machine is full).
    cpu_s: float | None = None
    #: ``cpu_s`` by kind of thread (``process.tree_thread_cpu``): main, librdkafka, other.
    cpu_threads_s: dict[str, float] = field(default_factory=dict)
    machine_busy_cores: float | None = None
    #: Of ``machine_busy_cores``, the cores the hypervisor took (steal; 0 on a quiet host).
    machine_steal_cores: float | None = None
    #: Seconds the system's main threads (a worker's task thread) were runnable but waited for
    #: a CPU, over the same window (``process.tree_main_waits``); per process.
    main_wait_s: float | None = None
    stopped_by: str = ""
    profiled: bool = False
    profile: str = ""
    log: str = ""
    log_tail: str = ""

    def fail(self, problem: str) -> None:
        self.status = "FAILED"
        self.problems.append(problem)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Bench:
    """Shared context of a benchmark: broker, input topic, expected effect, work directory."""

    def __init__(self, bootstrap: str, topics: Topics, prefix: str, workdir: Path,
                 settings: Settings) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.prefix = prefix
        self.workdir = workdir
        self.settings = settings

    def _start(self, system: System, in_topic: str, tag: str, profile: bool,
               ledger: LatencyLedger | None = None
               ) -> tuple[Child, ChildEnv, RunResult, Verifier]:
        """Create the output topic, start the verifier on it, then start the system."""
        s = self.settings
        group = f"{self.prefix}-{system.name}-{tag}"
        out_topic = self.topics.create(f"{group}-out", s.partitions)
        rundir = self.workdir / f"{system.name}-{tag}"
        rundir.mkdir(parents=True, exist_ok=True)
        env = ChildEnv(
            bootstrap=self.bootstrap, in_topic=in_topic, out_topic=out_topic, group=group,
            start_file=str(rundir / "started"), stats_file=str(rundir / "stats.json"),
            state_dir=str(rundir / "state"), commit_interval=s.commit_interval,
            backend=system.backend, guarantee=system.guarantee,
        )
        profile_to = None
        if profile and s.profile_dir is not None:
            s.profile_dir.mkdir(parents=True, exist_ok=True)
            profile_to = s.profile_dir / f"{system.name}-{tag}.pyisession"
        verifier = Verifier(self.bootstrap, out_topic, s.partitions, system.mode, ledger)
        log = rundir / "process.log"
        child_env = {**env.to_environ(), **system.extra_env,
                     METRICS_ENV: str(rundir / "metrics.jsonl")}
        try:
            child = Child(system.argv(self.bootstrap, profile_to), child_env, log)
        except BaseException:
            verifier.stop()
            raise
        result = RunResult(system=system.name, kind="", repetition=0, log=str(log),
                           profiled=profile_to is not None,
                           profile=str(profile_to) if profile_to else "")
        return child, env, result, verifier

    def _wait_started(self, child: Child, env: ChildEnv) -> tuple[float | None, str]:
        deadline = time.monotonic() + self.settings.startup_timeout
        while time.monotonic() < deadline:
            started = read_start_time(env.start_file)
            if started is not None:
                return started, ""
            if not child.running():
                return None, "the process exited before consuming anything"
            time.sleep(0.05)
        return None, f"consumed nothing within {self.settings.startup_timeout:.0f}s"

    def _finish(self, child: Child, verifier: Verifier, result: RunResult, env: ChildEnv,
                system: System, expected: Expected) -> Exit:
        exit_ = child.stop(self.settings.stop_grace)
        verifier.drain()
        verifier.stop()
        result.stopped_by = exit_.stopped_by
        result.peak_rss_mb = round(exit_.peak_rss_mb, 1)
        result.outputs = verifier.count
        if exit_.stopped_by == "SIGKILL":
            result.problems.append(f"did not stop within {self.settings.stop_grace:.0f}s of "
                                   "SIGTERM; killed")
        elif exit_.returncode not in (0, -15, 143):
            result.problems.append(f"exited with code {exit_.returncode}")
        if verifier.errors:
            result.fail("verifier: " + "; ".join(verifier.errors[:3]))
        if result.status == "ok":  # a run that never finished has already said why
            for problem in check(verifier.tally, expected, system.exactly_once):
                result.fail("wrong output: " + problem)
        if result.status != "ok" or result.problems:
            result.log_tail = exit_.log_tail
        stats = read_stats(env.stats_file)
        if stats.get("commit_durations_s"):
            result.commit_s = _rounded(summarize(stats["commit_durations_s"]))
        metrics = checkpoint_metrics(Path(result.log).with_name("metrics.jsonl"))
        if metrics["commit"]:
            result.commit_s = _rounded(summarize(metrics["commit"]))
            result.checkpoint_s = _rounded(summarize(metrics["checkpoint"]))
            result.state_bytes = int(max(metrics["state_bytes"]))
        if metrics["failed"]:
            result.problems.append(f"{len(metrics['failed'])} checkpoints failed")
        if result.profile:
            rendered = render(Path(result.profile))
            result.profile = ", ".join(str(p) for p in rendered) or result.profile
        self.topics.delete([env.out_topic])
        self.topics.delete_containing(env.group)  # the peer's changelog topics
        shutil.rmtree(env.state_dir, ignore_errors=True)
        shutil.rmtree(Path(env.state_dir).parent / ".snapline-local", ignore_errors=True)
        return exit_

    # ------------------------------------------------------------------ runs
    def throughput(self, system: System, in_topic: str, expected: Expected,
                   repetition: int, profile: bool = False) -> RunResult:
        """Process the whole shared input once; time it and verify the output."""
        s = self.settings
        n = expected.count
        child, env, result, verifier = self._start(system, in_topic, f"r{repetition}", profile)
        result.kind, result.repetition, result.records = "throughput", repetition, n
        try:
            started, why = self._wait_started(child, env)
            if started is None:
                result.fail(why)
            else:
                cpu_before, machine_before = tree_cpu_seconds(child.pid), machine_cpu()
                threads_before = tree_thread_cpu(child.pid)
                waits_before = tree_main_waits(child.pid)
                result.startup_s = round(started - child.started_at, 3)
                hard = s.startup_timeout + n / s.min_rate
                seen, why = verifier.wait_for(n, hard, s.stall_timeout, child.running)
                if seen is None:
                    result.fail(why)
                else:
                    machine_after = machine_cpu()
                    result.cpu_s = round(tree_cpu_seconds(child.pid) - cpu_before, 2)
                    threads_after = tree_thread_cpu(child.pid)
                    result.cpu_threads_s = {
                        kind: round(threads_after[kind] - threads_before[kind], 2)
                        for kind in threads_after
                    }
                    result.main_wait_s = round(tree_main_waits(child.pid) - waits_before, 2)
                    window = machine_after[1] - machine_before[1]
                    if window > 0:
                        cores = os.cpu_count() or 1
                        busy = (machine_after[0] - machine_before[0]) / window
                        steal = (machine_after[2] - machine_before[2]) / window
                        result.machine_busy_cores = round(busy * cores, 2)
                        result.machine_steal_cores = round(steal * cores, 2)
                    result.elapsed_s = round(seen - started, 3)
                    result.wall_s = round(seen - child.started_at, 3)
                    result.records_per_s = round(n / max(seen - started, 1e-6), 1)
                    steady = verifier.steady_records_per_s(n, started, seen)
                    result.steady_records_per_s = None if steady is None else round(steady, 1)
        finally:
            self._finish(child, verifier, result, env, system, expected)
        if result.status != "ok":
            result.records_per_s = result.steady_records_per_s = None
        return result

    def latency(self, system: System) -> RunResult:
        """Produce at a fixed rate into a fresh topic while the system runs; measure the
        produce → visible-to-read_committed latency of every record after a warm-up."""
        s = self.settings
        in_topic = self.topics.create(f"{self.prefix}-{system.name}-lat-in", s.partitions)
        producer = RateProducer(self.bootstrap, in_topic, s.latency_keys, keyed_by=s.keyed_by)
        try:
            child, env, result, verifier = self._start(system, in_topic, "lat", False,
                                                       producer.ledger)
        except BaseException:
            producer.close()
            raise
        result.kind = "latency"
        try:
            why = self._warm_up(child, producer, verifier)
            if why:
                result.fail(why)
            else:
                producer.ledger.start_measuring()
                producer.run_at_rate(s.latency_rate, s.latency_seconds)
                if not producer.join(s.latency_seconds + 30):
                    result.fail("the rate producer did not finish")
                else:
                    seen, why = verifier.wait_for(producer.produced, s.stall_timeout,
                                                  s.stall_timeout, child.running)
                    if seen is None:
                        result.fail(why)
        finally:
            producer.close()
            result.records = producer.produced
            self._finish(child, verifier, result, env, system, producer.ledger.expected)
            self.topics.delete([in_topic])
        lat = verifier.tally.latencies
        achieved = len(lat) / s.latency_seconds if s.latency_seconds else 0.0
        result.latency_s = _rounded({**summarize(lat), "p95": percentile(lat, 95),
                                     "rate_per_s": achieved})
        if verifier.tally.unmatched:
            result.fail(f"{verifier.tally.unmatched} outputs match no produced input")
        return result

    def _warm_up(self, child: Child, producer: RateProducer, verifier: Verifier) -> str:
        """Trickle records until the system outputs and has caught up; "" when ready."""
        deadline = time.monotonic() + self.settings.startup_timeout
        while verifier.count == 0:
            if time.monotonic() > deadline:
                return f"no output within {self.settings.startup_timeout:.0f}s of start"
            if not child.running():
                return "the process exited during warm-up"
            producer.produce_one()
            time.sleep(0.1)
        producer.join(0)
        seen, why = verifier.wait_for(producer.produced, self.settings.stall_timeout,
                                      self.settings.stall_timeout, child.running)
        return why if seen is None else ""


def _rounded(values: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in values.items()}
