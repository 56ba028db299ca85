"""The baselines: a plain confluent-kafka read → keyed running total → produce loop.

Baseline A (``--transactions``) is exactly-once the way any librdkafka program does it: one
Kafka transaction per commit interval that carries the outputs and the consumed offsets
(send_offsets_to_transaction). It is the practical limit for exactly-once in Python.
Baseline B (``--no-transactions``) is the same loop at-least-once: flush, then commit offsets.

Runs as its own process (``python -m benchmarks.baselines``), configured by ``ChildEnv``.
Single-threaded: the loop owns the state dict; librdkafka's threads do the I/O. Because one
process holds every key's state in one dict, the input's partitioning does not matter to it:
on input keyed by order id (the stages suite) it needs no repartition, which is what a
hand-written program on one machine would do, and so the fair baseline for a 2-stage job.
"""

from __future__ import annotations

import argparse
import signal
import time
from types import FrameType

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from benchmarks.child_env import ChildEnv, StartMarker, write_stats

BATCH = 10_000


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop finishes its current commit interval cleanly."""

    def __init__(self) -> None:
        self.stopped = False
        signal.signal(signal.SIGTERM, self._set)
        signal.signal(signal.SIGINT, self._set)

    def _set(self, _signum: int, _frame: FrameType | None) -> None:
        self.stopped = True


def consumer_config(env: ChildEnv) -> dict[str, object]:
    return {
        "bootstrap.servers": env.bootstrap,
        "group.id": env.group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "enable.partition.eof": False,
        # As Snapline's workers: without it librdkafka's 1 s fetch queue backoff caps the read
        # rate (~120-220k records/s here), whatever the loop does (runtime/worker.py).
        "fetch.queue.backoff.ms": 10,
    }


def producer_config(env: ChildEnv, transactional: bool) -> dict[str, object]:
    config: dict[str, object] = {
        "bootstrap.servers": env.bootstrap,
        "linger.ms": 5,
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
        "enable.idempotence": True,
    }
    if transactional:
        config["transactional.id"] = f"{env.group}-txn"
    return config


def _produce(producer: Producer, topic: str, value: bytes, key: bytes | None) -> None:
    while True:
        try:
            producer.produce(topic, value, key)
            return
        except BufferError:  # the producer queue is full: let librdkafka send
            producer.poll(0.01)


def run(env: ChildEnv, transactional: bool) -> dict[str, object]:
    stop = StopFlag()
    marker = StartMarker(env.start_file)
    consumer = Consumer(consumer_config(env))
    producer = Producer(producer_config(env, transactional))
    if transactional:
        producer.init_transactions(30)
    consumer.subscribe([env.in_topic])

    totals: dict[str, int] = {}
    offsets: dict[int, int] = {}
    commit_durations: list[float] = []
    processed = 0
    pending = 0
    out_topic = env.out_topic
    loads, dumps = orjson.loads, orjson.dumps

    if transactional:
        producer.begin_transaction()
    interval_start = time.monotonic()

    def commit() -> None:
        nonlocal pending, interval_start
        started = time.monotonic()
        positions = [TopicPartition(env.in_topic, p, o) for p, o in offsets.items()]
        if transactional:
            producer.send_offsets_to_transaction(positions, consumer.consumer_group_metadata(),
                                                 30)
            producer.commit_transaction(60)
            producer.begin_transaction()
        else:
            producer.flush(60)
            consumer.commit(offsets=positions, asynchronous=False)
        commit_durations.append(time.monotonic() - started)
        pending = 0
        interval_start = time.monotonic()

    try:
        while not stop.stopped:
            messages = consumer.consume(num_messages=BATCH, timeout=0.05)
            if messages:
                marker.mark()
            for msg in messages:
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(err)
                value = loads(msg.value())
                customer = value["customer"]
                total = totals.get(customer, 0) + value["amount"]
                totals[customer] = total
                # Keyed by customer, whatever the input's key: a key's outputs stay in order.
                _produce(producer, out_topic, dumps({"customer": customer, "total": total}),
                         customer.encode())
                offsets[msg.partition()] = msg.offset() + 1
            processed += len(messages)
            pending += len(messages)
            producer.poll(0)
            if pending and time.monotonic() - interval_start >= env.commit_interval:
                commit()
        if pending:
            commit()
        if transactional:
            producer.abort_transaction(30)  # the empty transaction opened by the last commit
    finally:
        consumer.close()
        producer.flush(30)
    return {"processed": processed, "commit_durations_s": commit_durations,
            "keys": len(totals)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--transactions", dest="transactional", action="store_true")
    group.add_argument("--no-transactions", dest="transactional", action="store_false")
    args = parser.parse_args()
    env = ChildEnv.from_environ()
    stats = run(env, args.transactional)
    write_stats(env.stats_file, stats)


if __name__ == "__main__":
    main()
