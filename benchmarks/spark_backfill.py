"""Backfill benchmark: the 2-stage warehouse pipeline (orders keyed by order id, re-keyed by
customer; Kafka and Parquet sinks) over the same N orders, on Spark ``local[2]``
(``snapline spark run``) and as services (``snapline run --workers 2``), each verified
exactly-once by a read_committed reader. Same broker, same input, same machine.

    python -m benchmarks.spark_backfill [--orders 200000]

Prints records/s of each (wall time from the command's start to the last output committed,
Spark's start-up included) and writes ``benchmarks/results/spark-backfill-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from snapline.connectors.local.broker import LocalKafkaBroker

REPO = Path(__file__).resolve().parent.parent


def _env(bootstrap: str, job: str, workdir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "SNAPLINE_BOOTSTRAP_SERVERS": bootstrap,
        "SNAPLINE_CHECKPOINT_DIR": str(workdir / "checkpoints"),
        "SNAPLINE_EXAMPLE_PREFIX": f"{job}-",
        "SNAPLINE_EXAMPLE_JOB": job,
        "SNAPLINE_EXAMPLE_STAGES": "2",
        "SNAPLINE_WAREHOUSE": str(workdir / "table"),
    }


def measure(bootstrap: str, orders: int, system: str, root: Path) -> dict[str, float]:
    job = f"bench-{system}-{int(time.time())}"
    workdir = root / system
    workdir.mkdir(parents=True)
    create_topics(bootstrap, {f"{job}-orders": 4, f"{job}-customer-totals": 4})
    expected = produce_orders(bootstrap, f"{job}-orders", orders, 5000, keyed_by_order=True)
    env = _env(bootstrap, job, workdir)
    started = time.monotonic()
    if system == "spark":
        subprocess.run(
            [
                sys.executable,
                "-m",
                "snapline.pipeline.cli",
                "spark",
                "run",
                "examples.warehouse:pipeline",
                "--master",
                "local[2,4]",
            ],
            env=env,
            cwd=workdir,
            check=True,
            capture_output=True,
            timeout=1800,
        )
        outputs = read_committed(bootstrap, f"{job}-customer-totals", orders, timeout=60)
        finished = time.monotonic()
    else:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "snapline.pipeline.cli",
                "run",
                "examples.warehouse:pipeline",
                "--workers",
                "2",
            ],
            env=env,
            cwd=workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            outputs = read_committed(
                bootstrap, f"{job}-customer-totals", orders, timeout=1800, settle=0.0
            )
            finished = time.monotonic()
        finally:
            process.terminate()
            process.wait(60)
    result = verify_totals(outputs, expected, range(orders))
    if not result.ok:
        raise SystemExit(f"{system}: {result.summary()}")
    seconds = finished - started
    return {"seconds": seconds, "records_per_s": orders / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", type=int, default=200_000)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with LocalKafkaBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        bootstrap = broker.start()
        results = {
            system: measure(bootstrap, args.orders, system, Path(tmp))
            for system in ("services", "spark")
        }
    print("| system | records | seconds | records/s |")
    print("| --- | ---: | ---: | ---: |")
    for system, r in results.items():
        print(f"| {system} | {args.orders:,} | {r['seconds']:.1f} | {r['records_per_s']:,.0f} |")
    ratio = results["spark"]["records_per_s"] / results["services"]["records_per_s"]
    print(f"spark / services: {ratio:.2f}; load average {load_before} → {os.getloadavg()}")
    out = REPO / "benchmarks" / "results" / f"spark-backfill-{time.strftime('%Y%m%d-%H%M')}.json"
    out.write_text(
        json.dumps(
            {"orders": args.orders, "results": results, "load": [load_before, os.getloadavg()]}
        )
    )


if __name__ == "__main__":
    main()
