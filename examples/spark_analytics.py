"""Analyse a Snapline Parquet table with Spark: totals per customer, and an exactly-once check.

    python -m examples.spark_analytics warehouse/customer_totals [--top 10]

Expected columns (what the sink writes, one row per pipeline output):

- running-total tables — the output of ``examples.running_total`` written by
  ``ParquetSink(path, checkpoint_column="checkpoint")``: ``customer`` (string), ``total``
  (number), ``count`` (int: the customer's number of inputs so far), ``order_id`` and
  ``checkpoint``. The customer's total is the ``total`` of its row with the highest ``count``
  (with refunds, totals go down, so ``max(total)`` would be wrong). Every input produced
  exactly one row, so a customer must have exactly ``max(count)`` rows with counts 1..n:
  fewer means a lost output, more a duplicate. The script checks that and exits 1 if not.
- contribution tables — one row per input: ``customer`` and ``amount`` (optionally ``day``
  as a partition column and ``checkpoint``): the total is ``sum(amount)``.

Spark sees committed checkpoints only: staged files live under ``_staging`` and Spark skips
paths that start with ``_``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Analysis:
    """What the script found: a row per customer and the table-wide numbers."""

    kind: str  #: "running-total" or "contributions"
    customers: list[dict[str, Any]]  #: customer, total, rows (and count) — largest totals first
    rows: int
    checkpoints: int
    max_checkpoint: int | None
    #: Customers whose rows do not match their count (running-total tables only).
    mismatches: list[dict[str, Any]]


def spark_session(app: str = "snapline-spark-analytics") -> Any:
    """A local[2] session, quiet, without the web UI."""
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    return session


def analyse(spark: Any, table: str) -> Analysis:
    from pyspark.sql import functions as F

    df = spark.read.parquet(table)
    columns = set(df.columns)
    if "customer" not in columns:
        raise SystemExit(f"{table} has no 'customer' column (columns: {sorted(columns)})")
    mismatches: list[dict[str, Any]] = []
    if {"total", "count"} <= columns:
        kind = "running-total"
        per_customer = df.groupBy("customer").agg(
            F.max_by("total", "count").alias("total"),
            F.max("count").alias("count"),
            F.count(F.lit(1)).alias("rows"),
            F.countDistinct("count").alias("distinct_counts"),
        )
        bad = per_customer.where(
            (F.col("rows") != F.col("count")) | (F.col("distinct_counts") != F.col("count"))
        )
        mismatches = [r.asDict() for r in bad.orderBy("customer").limit(20).collect()]
    elif "amount" in columns:
        kind = "contributions"
        per_customer = df.groupBy("customer").agg(
            F.sum("amount").alias("total"), F.count(F.lit(1)).alias("rows")
        )
    else:
        raise SystemExit(
            f"{table} has neither total+count (running totals) nor amount (contributions); "
            f"columns: {sorted(columns)}"
        )
    customers = [r.asDict() for r in per_customer.orderBy(F.desc("total"), "customer").collect()]
    if "checkpoint" in columns:
        stats = df.agg(F.countDistinct("checkpoint"), F.max("checkpoint")).first()
        checkpoints, max_checkpoint = int(stats[0]), stats[1]
    else:
        checkpoints, max_checkpoint = 0, None
    return Analysis(
        kind, customers, sum(c["rows"] for c in customers), checkpoints, max_checkpoint, mismatches
    )


def report(analysis: Analysis, table: str, top: int) -> str:
    lines = [
        f"{table}: {analysis.kind} table, {analysis.rows} committed rows, "
        f"{len(analysis.customers)} customers"
    ]
    if analysis.max_checkpoint is not None:
        lines.append(
            f"  from {analysis.checkpoints} checkpoints (latest id {analysis.max_checkpoint})"
        )
    lines.append(f"  {'customer':<16} {'total':>14} {'rows':>8}")
    for row in analysis.customers[:top]:
        lines.append(f"  {row['customer']!s:<16} {row['total']:>14} {row['rows']:>8}")
    if len(analysis.customers) > top:
        lines.append(f"  ... {len(analysis.customers) - top} more")
    grand = sum(c["total"] or 0 for c in analysis.customers)
    lines.append(f"  {'all customers':<16} {grand:>14} {analysis.rows:>8}")
    if analysis.kind == "running-total":
        if analysis.mismatches:
            lines.append(
                f"exactly-once check FAILED for {len(analysis.mismatches)} customers "
                "(rows vs count):"
            )
            lines.extend(f"  {m}" for m in analysis.mismatches)
        else:
            lines.append(
                "exactly-once check: every customer has exactly one row per input "
                "(rows == count, counts 1..n): OK"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, spark: Any = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.spark_analytics", description=__doc__.splitlines()[0]
    )
    parser.add_argument("table", help="directory of a ParquetSink table")
    parser.add_argument("--top", type=int, default=10, help="customers to list (default 10)")
    args = parser.parse_args(argv)
    from pyspark.errors import AnalysisException

    own = spark is None
    session = spark_session() if own else spark
    try:
        try:
            analysis = analyse(session, args.table)
        except AnalysisException as exc:
            print(f"{args.table}: no committed rows yet ({str(exc).splitlines()[0]})")
            return 2
        print(report(analysis, args.table, args.top))
        return 1 if analysis.mismatches else 0
    finally:
        if own:
            session.stop()


if __name__ == "__main__":
    sys.exit(main())
