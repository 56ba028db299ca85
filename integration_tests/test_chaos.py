"""Mixed faults in a random order while input flows: a worker SIGKILLed, every worker
SIGKILLed at once, a worker frozen (SIGSTOP) past its session timeout and woken as a zombie
(sometimes with another worker SIGKILLed while it is frozen), and the broker SIGKILLed and
restarted. Three workers of the warehouse pipeline (Kafka + Parquet + PostgreSQL sinks,
rocksdb state; in a long variant, memory state and a re-keying stage through a repartition
topic) on the test's own broker. Independent readers (a read_committed consumer,
pyarrow on the table, SQL on the database) must then find every input's effect exactly once.

Each kind of fault has its own focused test (test_exactly_once_kill.py, test_broker_bounces.py);
this one mixes them, as an outside black-box test would. The default run has 5 rounds, each
kind once; ``-m long`` runs 40 with each configuration (about 7 minutes each).

The test plays the supervisor, as the bounce tests do: a worker that exits by itself is
restarted, and only exit code 75 (EX_TEMPFAIL) is accepted.
"""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from integration_tests.bounces import BounceJob, BounceRun, SingleBroker, judge_on_single_broker

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.slow]

SHORT, LONG = 5, 40
#: Kinds of round; a schedule repeats this list, shuffled: each kind once in the first 5
#: rounds (the short run), and a worker SIGKILLed twice as often as the others in 6.
KINDS = ["kill", "kill-all", "zombie", "zombie+kill", "broker", "kill"]
#: Frozen longer than the workers' session timeout (10 s): the others take its partitions.
FROZEN_S = (12.0, 15.0)


@pytest.mark.parametrize(
    ("rounds", "backend", "stages"),
    [
        (SHORT, "rocksdb", 1),
        pytest.param(LONG, "rocksdb", 1, marks=pytest.mark.long),
        pytest.param(LONG, "memory", 2, marks=pytest.mark.long),
    ],
    ids=["5-rounds", "40-rounds", "40-rounds-2-stages"],
)
def test_mixed_faults_lose_and_duplicate_nothing(
    postgres_dsn: str, tmp_path: Path, unique_name: str, rounds: int, backend: str, stages: int
) -> None:
    broker = SingleBroker(tmp_path / "kafka")
    rng = random.Random(rounds)
    schedule = [KINDS[i % len(KINDS)] for i in range(rounds)]
    rng.shuffle(schedule)
    done: Counter[str] = Counter()
    try:
        job = BounceJob(
            broker.bootstrap,
            unique_name,
            tmp_path,
            postgres_dsn,
            workers=3,
            backend=backend,
            stages=stages,
        )
        run = BounceRun(job, seed=rounds)
        try:
            run.start()
            for kind in schedule:
                job.supervise()
                if kind == "kill":
                    victim = rng.choice(job.workers)
                    victim.kill()
                    run.test_kills += 1
                    victim.start()
                elif kind == "kill-all":
                    for worker in job.workers:
                        worker.kill()
                        run.test_kills += 1
                    for worker in job.workers:
                        worker.start()
                elif kind.startswith("zombie"):
                    frozen, *others = rng.sample(job.workers, len(job.workers))
                    frozen.signal(signal.SIGSTOP)
                    time.sleep(rng.uniform(*FROZEN_S) / 2)
                    if kind == "zombie+kill":
                        # Its partitions move while another worker is gone too.
                        others[0].kill()
                        run.test_kills += 1
                        others[0].start()
                    time.sleep(rng.uniform(*FROZEN_S) / 2)
                    frozen.signal(signal.SIGCONT)
                else:
                    outage = run.begin("kill")
                    broker.crash()
                    time.sleep(rng.uniform(1.0, 3.0))
                    back_at = broker.start()
                    run.end(outage, back_at, None, f"broker start {broker.start_seconds[-1]:.1f}s")
                done[kind] += 1
                time.sleep(rng.uniform(1.0, 4.0))
            outputs = run.finish()
        finally:
            run.abandon()

        check = run.report(outputs, f"chaos {dict(done)}")
        assert sum(done.values()) == rounds and set(done) == set(KINDS)
        judge_on_single_broker(run, check, broker)
    finally:
        broker.stop()
