"""The peer: Quix Streams running the same keyed running total, exactly-once.

Quix Streams keeps state per message key in RocksDB with a changelog topic, and with
``processing_guarantee="exactly-once"`` commits outputs, changelog and offsets in one Kafka
transaction every ``commit_interval``. The input is already keyed by customer, so no
repartition is needed: ``sdf.apply(..., stateful=True)`` sees the state of the record's key.
With ``--group-by`` (the stages suite, input keyed by order id) ``sdf.group_by("customer")``
first re-keys through Quix Streams' repartition topic, inside the same transactions.

Runs as its own process (``python -m benchmarks.quix_peer``), configured by ``ChildEnv``.
Checkpoint commit durations are measured by wrapping ``Checkpoint.commit``; nothing else of
Quix Streams is changed.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from benchmarks.child_env import ChildEnv, StartMarker, write_stats


def _time_checkpoint_commits(durations: list[float]) -> None:
    from quixstreams.checkpointing.checkpoint import Checkpoint

    original: Callable[..., Any] = Checkpoint.commit

    def timed_commit(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return original(self, *args, **kwargs)
        finally:
            durations.append(time.monotonic() - started)

    Checkpoint.commit = timed_commit  # type: ignore[method-assign]


def running_total_app(env: ChildEnv, keep_note: bool = False, group_by: bool = False) -> Any:
    """The Quix Streams application of the benchmark (``keep_note``: the recovery variant,
    whose state holds ~150 bytes per key; ``group_by``: re-key by customer first)."""
    from quixstreams import Application, State

    app = Application(
        broker_address=env.bootstrap,
        consumer_group=env.group,
        auto_offset_reset="earliest",
        commit_interval=env.commit_interval,
        processing_guarantee="exactly-once",
        state_dir=env.state_dir,
        loglevel=os.environ.get("BENCH_QUIX_LOGLEVEL", "WARNING"),  # type: ignore[arg-type]
        # The same group settings as a Snapline worker: a stable member and transactional id,
        # so a restarted process takes over at once instead of waiting for timeouts.
        consumer_extra_config={
            "enable.partition.eof": False,
            "group.instance.id": f"{env.group}-0",
            "session.timeout.ms": 10000,
            "heartbeat.interval.ms": 1000,
            "fetch.queue.backoff.ms": 10,  # as every system here (baselines.py)
        },
        producer_extra_config={"transactional.id": f"{env.group}-0"},
    )
    source = app.topic(env.in_topic, value_deserializer="json", key_deserializer="string")
    sink = app.topic(env.out_topic, value_serializer="json", key_serializer="string")
    marker = StartMarker(env.start_file)

    def running_total(value: dict[str, Any], state: State) -> dict[str, Any]:
        marker.mark()
        if keep_note:
            last = state.get("last") or {"total": 0}
            total = last["total"] + value["amount"]
            state.set("last", {"total": total, "note": value["note"]})
        else:
            total = state.get("total", 0) + value["amount"]
            state.set("total", total)
        return {"customer": value["customer"], "total": total}

    sdf = app.dataframe(source)
    if group_by:

        def customer(value: dict[str, Any]) -> str:
            # What group_by("customer") does, plus the start mark: the run starts when the
            # first stage sees its first record, not after its first commit.
            marker.mark()
            return value["customer"]  # type: ignore[no-any-return]

        sdf = sdf.group_by(customer, name="customer")
    sdf = sdf.apply(running_total, stateful=True)
    sdf.to_topic(sink)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keep-note", action="store_true",
                        help="store the record's note in state (recovery benchmark)")
    parser.add_argument("--group-by", action="store_true",
                        help="re-key by customer with sdf.group_by (input keyed by order id)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    logging.basicConfig(level=logging.WARNING)
    env = ChildEnv.from_environ()
    durations: list[float] = []
    _time_checkpoint_commits(durations)
    app = running_total_app(env, keep_note=args.keep_note, group_by=args.group_by)
    try:
        app.run()
    finally:
        write_stats(env.stats_file, {"commit_durations_s": durations})


if __name__ == "__main__":
    main()
