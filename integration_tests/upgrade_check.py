"""Upgrade check: workers of an earlier version SIGKILLed mid-run, this version continues.

``python -m integration_tests.upgrade_check REV [--orders N] [--stages 1|2|3]`` checks out
``REV`` (a commit of this repository, e.g. the last one that landed) into a temporary git
worktree, starts an embedded broker and two workers of ``REV`` running
``examples.warehouse:pipeline`` (the slow variant, re-keyed ``--stages - 1`` times, so records
are in flight in the repartition topics), SIGKILLs both once an eighth of the output is
committed, produces the second half of the orders, and starts two workers of this working
tree on the same checkpoint directory. Exit 0 if every order is counted exactly once in the
Kafka output (an independent read_committed consumer) and in the Parquet table (pyarrow), 1
otherwise, 2 if the kill did not come mid-run (nothing checked). Not part of the test suite:
it needs the git history and takes about a minute.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from examples.orders import create_topics, produce_orders, read_committed, verify_totals
from snapline import LocalKafkaBroker

REPO = Path(__file__).resolve().parent.parent


def _worker(repo: Path, worker_id: str, bootstrap: str, work: Path, env: dict[str, str]) -> Any:
    log = open(work / f"{worker_id}-{repo.name}.log", "ab")  # noqa: SIM115 (the child's)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "snapline.pipeline.cli",
            "run",
            "examples.warehouse:pipeline",
            "--bootstrap-servers",
            bootstrap,
            "--checkpoint-dir",
            str(work / "checkpoints"),
            "--worker-id",
            worker_id,
        ],
        cwd=str(work),
        env={**os.environ, **env, "PYTHONPATH": str(repo)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("rev", help="the earlier version: a commit of this repository")
    parser.add_argument("--orders", type=int, default=40_000)
    parser.add_argument("--stages", choices=["1", "2", "3"], default="3")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="snapline-upgrade-"))
    old = work / "old"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), args.rev], check=True
    )
    broker = LocalKafkaBroker()
    bootstrap = broker.start()
    job = f"upgrade-{uuid.uuid4().hex[:6]}"
    prefix, table, total = f"{job}-", work / "table", args.orders
    env = {
        "SNAPLINE_EXAMPLE_PREFIX": prefix,
        "SNAPLINE_EXAMPLE_JOB": job,
        "SNAPLINE_WAREHOUSE": str(table),
        "SNAPLINE_EXAMPLE_STAGES": args.stages,
        "SNAPLINE_EXAMPLE_VARIANT": "slow",
    }
    workers: list[Any] = []
    try:
        create_topics(bootstrap, {f"{prefix}orders": 4, f"{prefix}customer-totals": 4})
        expected = produce_orders(bootstrap, f"{prefix}orders", total // 2, 300)
        workers = [_worker(old, f"w{i}", bootstrap, work, env) for i in range(2)]
        deadline = time.monotonic() + 120  # the old workers commit an eighth, or this ends
        seen = 0
        while seen < total // 8 and time.monotonic() < deadline:
            time.sleep(0.5)
            seen = len(
                read_committed(bootstrap, f"{prefix}customer-totals", 0, timeout=1, settle=0)
            )
        for worker in workers:
            worker.kill()
            worker.wait(30)
        done = len(read_committed(bootstrap, f"{prefix}customer-totals", 0, timeout=2, settle=0))
        print(f"[upgrade] {args.rev}'s workers SIGKILLed after {done} committed outputs")
        if not total // 8 <= done < total // 2:  # not mid-run: the check would check nothing
            print(
                f"[upgrade] NOT CHECKED: the kill came at {done} of {total // 2} outputs, not "
                "mid-run (too few: the old version did not run; all: raise --orders)"
            )
            return 2
        rest = produce_orders(
            bootstrap, f"{prefix}orders", total - total // 2, 300, start_id=total // 2
        )
        for customer, amount in rest.items():
            expected[customer] = expected.get(customer, 0) + amount
        workers = [_worker(REPO, f"w{i}", bootstrap, work, env) for i in range(2)]
        outputs = read_committed(
            bootstrap, f"{prefix}customer-totals", total, timeout=300, settle=5
        )
        kafka = verify_totals(outputs, expected, range(total))
        print(f"[upgrade] Kafka: {kafka.summary()}")
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(60)
        import pyarrow.parquet as pq

        ids = Counter(row["order_id"] for row in pq.read_table(str(table)).to_pylist())
        missing = sum(1 for i in range(total) if i not in ids)
        twice = sum(1 for n in ids.values() if n > 1)
        print(
            f"[upgrade] Parquet: {sum(ids.values())} rows, {missing} orders missing, {twice} twice"
        )
        ok = kafka.ok and missing == 0 and twice == 0
        print(f"[upgrade] {'OK' if ok else 'FAILED'}; logs in {work}")
        return 0 if ok else 1
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
        broker.stop()
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False
        )


if __name__ == "__main__":
    sys.exit(main())
