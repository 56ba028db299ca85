"""Broker bounces under live workers: the broker is SIGKILLed, stopped cleanly, crashed twice
in a row and kept down longer than the transaction timeout, while 2 workers of the warehouse
pipeline (Kafka + Parquet + PostgreSQL) process input and are themselves SIGKILLed now and
then. Workers that live through an outage must commit again by themselves (unless each one
exited 75 on a client call librdkafka left hung after the broker was back, #5456: reported,
and restarted as a supervisor would, as on a cluster); independent
readers (a read_committed consumer, pyarrow on the table, SQL on the database) must find
every input exactly once.

The test plays the supervisor: a worker that exits by itself is restarted, and only exit code
75 (EX_TEMPFAIL, "Kafka client cannot go on, restart me") is accepted. It prints the time from
broker-back to each surviving worker's first commit (p50, max).

CI runs the short schedule (the broker stopped, SIGKILLed twice in a row and SIGKILLed for
longer than the transaction timeout, and both of w0's actions, once each); the long one, with
repeats and plain SIGKILLs, runs with ``bash scripts/test -m long``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from integration_tests.bounces import (
    TRANSACTION_TIMEOUT_S,
    BounceJob,
    BounceRun,
    SingleBroker,
    judge_on_single_broker,
)

pytestmark = [pytest.mark.integration, pytest.mark.postgres, pytest.mark.slow]

# (kind, seconds down, what happens to worker w0 during the outage). Kinds: "kill" = SIGKILL
# of the broker JVM; "stop" = clean shutdown; "double" = SIGKILL, restart, SIGKILL again as
# soon as it serves, restart; "long" = SIGKILL and down for twice the transaction timeout.
# w0 during the outage: "term" = SIGTERM (must end within STOP_BOUND), "kill" = SIGKILL and
# restart while the broker is still down. w1 always lives through the outage.
LONG = [
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
# Each kind once, but "kill": "double" and "long" are SIGKILLs of the broker too, and "stop"
# has w0 SIGKILLed and restarted while the broker is down (CI time: each outage is ~30 s).
SHORT = [
    ("stop", 1.0, "kill"),
    ("double", 1.0, None),
    ("long", TRANSACTION_TIMEOUT_S * 2.0, "term"),
]


@pytest.mark.parametrize(
    "schedule",
    [SHORT, pytest.param(LONG, marks=pytest.mark.long)],
    ids=[f"{len(SHORT)}-outages", f"{len(LONG)}-outages"],
)
def test_workers_ride_out_broker_bounces(
    schedule: list[tuple[str, float, str | None]],
    postgres_dsn: str,
    tmp_path: Path,
    unique_name: str,
) -> None:
    cluster = SingleBroker(tmp_path / "kafka")
    try:
        job = BounceJob(cluster.bootstrap, unique_name, tmp_path, postgres_dsn)
        run = BounceRun(job, seed=9)
        try:
            run.start()
            for kind, down, w0_action in schedule:
                outage = run.begin(kind)
                if kind == "stop":
                    cluster.stop()
                else:
                    cluster.crash()
                if kind == "double":
                    cluster.start()
                    cluster.crash()
                run.during(outage, w0_action)
                time.sleep(max(0.0, down - (time.time() - outage.down_at)))
                back_at = cluster.start()
                run.end(
                    outage, back_at, w0_action, f"broker start {cluster.start_seconds[-1]:.1f}s"
                )
            outputs = run.finish()
        finally:
            run.abandon()

        check = run.report(outputs, "broker bounces")
        assert len(run.outages) == len(schedule) and run.test_kills >= 2
        judge_on_single_broker(run, check, cluster)
    finally:
        cluster.stop()
