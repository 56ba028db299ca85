"""The README demo: the running total, end to end, on the embedded Kafka broker.

Starts the broker, produces orders, runs two workers of ``examples.warehouse`` (Kafka output
plus a Parquet table under ``warehouse/demo_customer_totals``), SIGKILLs one mid-run and
restarts it, then reads the output with an independent read_committed consumer and prints
whether every order was counted exactly once. Run: ``python -m examples.demo``; then analyse
the table with ``python -m examples.spark_analytics warehouse/demo_customer_totals``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from examples.workers import WorkerProcess, read_events
from snapline import LocalKafkaBroker


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", type=int, default=100_000)
    parser.add_argument("--customers", type=int, default=1000)
    parser.add_argument(
        "--bootstrap-servers", default=None, help="use this cluster instead of the embedded broker"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--warehouse",
        default="warehouse/demo_customer_totals",
        help="Parquet table the demo writes (replaced on each run)",
    )
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="snapline-demo-"))
    broker = None
    if args.bootstrap_servers:
        bootstrap = args.bootstrap_servers
    else:
        say("starting the embedded Kafka broker (the first run downloads it with Maven)")
        broker = LocalKafkaBroker()
        bootstrap = broker.start()
    say(f"Kafka at {bootstrap}; work directory {workdir}")
    job = f"demo-{uuid.uuid4().hex[:6]}"
    prefix = f"{job}-"
    workers: list[WorkerProcess] = []
    try:
        create_topics(bootstrap, {f"{prefix}orders": 4, f"{prefix}customer-totals": 4})
        table = Path(args.warehouse).absolute()
        shutil.rmtree(table, ignore_errors=True)
        env = {
            "SNAPLINE_EXAMPLE_PREFIX": prefix,
            "SNAPLINE_EXAMPLE_JOB": job,
            "SNAPLINE_WAREHOUSE": str(table),
        }
        workers = [
            WorkerProcess(
                "examples.warehouse:pipeline",
                f"w{i}",
                bootstrap,
                workdir / "checkpoints",
                workdir,
                env,
            )
            for i in range(2)
        ]
        half = args.orders // 2
        expected = produce_orders(bootstrap, f"{prefix}orders", half, args.customers)
        say(f"produced {half} orders; starting 2 workers")
        for worker in workers:
            worker.start()
        time.sleep(4)
        victim = workers[1]
        say(f"SIGKILL worker {victim.worker_id} mid-run (no final checkpoint, open transaction)")
        victim.kill()
        rest = produce_orders(
            bootstrap, f"{prefix}orders", args.orders - half, args.customers, start_id=half
        )
        for customer, amount in rest.items():
            expected[customer] = expected.get(customer, 0) + amount
        say(f"produced {args.orders - half} more orders while it was down; restarting it")
        victim.start()
        say("reading the output with an independent read_committed consumer")
        outputs = read_committed(
            bootstrap, f"{prefix}customer-totals", args.orders, timeout=240, settle=3.0
        )
        result = verify_totals(outputs, expected, range(args.orders))
        events = read_events(workdir / "metrics.jsonl")
        checkpoints = sum(1 for e in events if e.get("event") == "checkpoint")
        assignments = sum(1 for e in events if e.get("event") == "assigned")
        say(
            f"{checkpoints} checkpoints committed; {assignments} partition assignments "
            "(each one a restore from the committed checkpoint)"
        )
        top = sorted(expected.items(), key=lambda kv: -kv[1])[:3]
        say("top customers: " + ", ".join(f"{c}={t}" for c, t in top))
        say(result.summary())
        say(
            f"Parquet table: {table} (committed checkpoints only; try "
            f"`python -m examples.spark_analytics {args.warehouse}`)"
        )
        if not result.ok:
            for worker in workers:
                print(worker.tail(), file=sys.stderr)
        return 0 if result.ok else 1
    finally:
        for worker in workers:
            worker.stop(timeout=30)
        if broker is not None:
            broker.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
