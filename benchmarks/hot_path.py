"""``python -m benchmarks.hot_path``: the per-record cost of the keyed path, without a broker.

The same input (JSON orders of ~100 B, 100,000 customers) runs through
- ``baseline``: the Python part of baseline A's loop (``orjson.loads``, a dict of totals,
  ``orjson.dumps``, a producer call);
- ``keyed``: a Snapline task of ``key_by() → process(RunningTotal) → KafkaSink`` (the harness's
  ``snapline-memory`` / ``snapline-rocksdb``), its real operators, state backend and sink
  writer, fed in chunks of 10,000 messages;
- ``two-stage``: the stages suite's pipeline (``key_by(customer)`` through a repartition topic):
  stage 1's task, then stage 2's task over what stage 1 produced.
The producer is a stub that takes the call and drops the record, so only the Python work of
the task thread is measured (no librdkafka threads, no broker, no checkpoints). With
``--epoch N`` the keyed task takes a barrier every N records: its synchronous snapshot (and
the state flush before it) is measured, the snapshot is then dropped.

Two measures:
- CPU time per record, the minimum over ``--repetitions`` (noisy on a shared machine);
- ``--instructions``: instructions per record counted by valgrind (callgrind), the difference
  of two runs of different lengths, so start-up and input generation cancel out. Exact and
  repeatable whatever the machine's load; slow (~30 s per system).

Messages are ``snapline.pipeline.record.ListedMessage`` objects (Python methods, where
confluent-kafka's are C): both systems read them the same way.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

import orjson

from snapline import (
    AggregateFunction,
    KafkaSink,
    KafkaSource,
    KeyedProcessFunction,
    Pipeline,
    ValueState,
)
from snapline.pipeline.record import ListedMessage
from snapline.pipeline.runtime.faults import FaultInjector
from snapline.pipeline.runtime.task import Task
from snapline.pipeline.runtime.worker import GC_THRESHOLDS
from snapline.pipeline.stages import task_id_for
from snapline.pipeline.state import create_backend

CHUNK = 10_000
SYSTEMS = ("baseline", "keyed", "aggregate", "two-stage")


class RunningTotal(KeyedProcessFunction):
    total: ValueState[int] = ValueState("total", default=0)

    def process(self, value: Any, ctx: Any) -> Any:
        t = self.total.value() + value["amount"]
        self.total.update(t)
        yield {"customer": ctx.key, "total": t}


class Total(AggregateFunction[dict[str, Any], int, int]):
    """The running total as a rolling aggregate (``key_by().aggregate(Total())``)."""

    def create_accumulator(self) -> int:
        return 0

    def add(self, value: dict[str, Any], accumulator: int) -> int:
        return accumulator + value["amount"]  # type: ignore[no-any-return]

    def get_result(self, accumulator: int) -> int:
        return accumulator


class _Producer:
    """Takes ``produce`` calls; keeps them as messages when ``keep`` (stage 1's output)."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self.out: list[ListedMessage] = []
        self.count = 0

    def produce(self, topic: str, value: Any = None, key: Any = None, **kwargs: Any) -> None:
        self.count += 1
        if self.keep:
            self.out.append(ListedMessage(topic, 0, len(self.out), value, key, 0))

    def poll(self, timeout: float = 0) -> int:
        return 0


class _Output:
    """The task's transactional output with its transaction always open."""

    def __init__(self, producer: _Producer) -> None:
        self.producer = producer

    def produce(self, epoch: int, topic: str, value: Any, key: Any, *args: Any) -> None:
        self.producer.produce(topic, value, key)

    def direct_producer(self, epoch: int) -> _Producer:
        return self.producer

    def sent(self, count: int) -> None:
        pass


def orders(count: int, keys: int) -> list[ListedMessage]:
    rng = random.Random(1)
    out = []
    for i in range(count):
        customer = f"c{rng.randrange(keys):07d}"
        value = orjson.dumps(
            {
                "customer": customer,
                "amount": rng.randint(1, 100),
                "ts": 1790000000123,
                "note": "x" * 30,
            }
        )
        out.append(ListedMessage("in", 0, i, value, customer.encode(), 1790000000123))
    return out


def baseline(messages: list[ListedMessage]) -> int:
    """Returns the number of outputs (as do ``keyed`` and ``two_stage``)."""
    totals: dict[str, int] = {}
    producer = _Producer()
    loads, dumps = orjson.loads, orjson.dumps
    for m in messages:
        v = loads(m.value())
        c = v["customer"]
        t = totals.get(c, 0) + v["amount"]
        totals[c] = t
        producer.produce("out", dumps({"customer": c, "total": t}), c.encode())
    return producer.count


def _task(
    pipeline: Pipeline,
    stage: int,
    channels: dict[tuple[str, int], int],
    backend: str,
    producer: _Producer,
    tmp: str,
    partitions: dict[str, int],
) -> Task:
    return Task(
        task_id_for(stage, 0),
        pipeline,
        channels,
        create_backend(backend, task_dir=f"{tmp}/local-{stage}", options={}),
        _Output(producer),  # type: ignore[arg-type]
        worker_id="hot-path",
        epoch=1,
        on_snapshot=lambda snapshot: None,
        faults=FaultInjector(""),
        stage=stage,
        plan=pipeline.stages(),
        topic_partitions=partitions,
        time_state=None,
        ttl_sweep_interval=0.0,
    )


def keyed(
    messages: list[ListedMessage], backend: str, epoch: int = 0, rolling: bool = False
) -> int:
    """``epoch``: records between two barriers (rounded up to whole chunks; 0: none).
    ``rolling``: the running total as ``aggregate(Total())`` instead of a process function."""
    tmp = tempfile.mkdtemp(prefix="snapline-hot-path-")
    pipeline = Pipeline("hot", checkpoint_dir=f"{tmp}/chk", state_backend=backend)
    keyed = pipeline.source(KafkaSource("in", value_format="json")).key_by()
    (keyed.aggregate(Total()) if rolling else keyed.process(RunningTotal())).sink(
        KafkaSink("out", value_format="json")
    )
    out = _Producer()
    task = _task(pipeline, 0, {("in", 0): 0}, backend, out, tmp, {})
    checkpoint = 0
    for i in range(0, len(messages), CHUNK):
        task.enqueue(("in", 0), messages[i : i + CHUNK])
        task.run()
        if epoch and (i + CHUNK) % epoch < CHUNK:
            checkpoint += 1
            task.inject_barrier(checkpoint)  # the snapshot is taken and dropped
            task.run()
    return out.count


def two_stage(messages: list[ListedMessage], backend: str) -> int:
    tmp = tempfile.mkdtemp(prefix="snapline-hot-path-")
    pipeline = Pipeline("hot", checkpoint_dir=f"{tmp}/chk", state_backend=backend)
    (
        pipeline.source(KafkaSource("in", value_format="json"))
        .key_by(lambda v: v["customer"], name="by-customer")
        .process(RunningTotal())
        .sink(KafkaSink("out", value_format="json"))
    )
    topic = next(iter(pipeline.stages().repartitions.values())).topic
    between = _Producer(keep=True)
    first = _task(pipeline, 0, {("in", 0): 0}, backend, between, tmp, {topic: 1})
    out = _Producer()
    second = _task(pipeline, 1, {(topic, 0): 0}, backend, out, tmp, {topic: 1})
    for i in range(0, len(messages), CHUNK):
        first.enqueue(("in", 0), messages[i : i + CHUNK])
        first.run()
        batch, between.out = between.out, []
        second.enqueue((topic, 0), batch)
        second.run()
    return out.count


def run_once(system: str, messages: list[ListedMessage], backend: str, epoch: int = 0) -> float:
    started = time.process_time()
    if system == "baseline":
        baseline(messages)
    elif system == "keyed":
        keyed(messages, backend, epoch)
    elif system == "aggregate":
        keyed(messages, backend, epoch, rolling=True)
    elif system == "two-stage":
        two_stage(messages, backend)
    elif system != "none":
        raise SystemExit(f"unknown system {system!r}")
    return time.process_time() - started


def _instructions(system: str, records: int, backend: str, keys: int, epoch: int) -> int:
    argv = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        "-m",
        "benchmarks.hot_path",
        "--child",
        system,
        "--records",
        str(records),
        "--backend",
        backend,
        "--keys",
        str(keys),
        "--epoch",
        str(epoch),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=True)
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise SystemExit(f"no instruction count from valgrind:\n{done.stderr[-2000:]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--backend", choices=["memory", "rocksdb"], default="memory")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--only", default=",".join(SYSTEMS))
    parser.add_argument(
        "--epoch",
        type=int,
        default=0,
        help="records between barriers of the keyed task (the harness: about "
        "150,000, one second); default 0, no barriers",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per record with valgrind (exact, slow)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import gc

    gc.set_threshold(*GC_THRESHOLDS)  # as in a worker (runtime/worker.py: tune_interpreter)
    if args.child is not None:
        run_once(args.child, orders(args.records, args.keys), args.backend, args.epoch)
        return
    systems = [s for s in args.only.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    print(
        f"{args.backend} backend, {args.keys:,} keys, barrier every {args.epoch:,} records "
        f"(0: none); load average {os.getloadavg()}"
    )
    if args.instructions:
        small, large = 10_000, 30_000
        base = {
            n: _instructions("none", n, args.backend, args.keys, args.epoch) for n in (small, large)
        }
        for system in systems:
            counts = {
                n: _instructions(system, n, args.backend, args.keys, args.epoch) - base[n]
                for n in (small, large)
            }
            per = (counts[large] - counts[small]) / (large - small)
            print(f"{system:>10}: {per:,.0f} instructions per record")
        return
    messages = orders(args.records, args.keys)
    for system in systems:
        best = min(
            run_once(system, messages, args.backend, args.epoch) for _ in range(args.repetitions)
        )
        print(
            f"{system:>10}: {best / len(messages) * 1e6:.2f} µs CPU per record "
            f"(min of {args.repetitions})"
        )


if __name__ == "__main__":
    main()
