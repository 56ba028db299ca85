"""The benchmark input: ~100-byte JSON records keyed by customer (or, for the stages suite, by
order id), and what a correct run outputs.

``prepare_input`` produces the throughput workload once; ``RateProducer`` produces the latency
workload at a fixed rate while a system runs. Both keep the expected effect of every record
(``Expected``) so the verifier can tell a correct run from a fast wrong one.
"""

from __future__ import annotations

import base64
import random
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import orjson
from confluent_kafka import KafkaException, Producer

RECORD_BYTES = 100
_BASE_TS_MS = 1_790_000_000_000


def customer_key(index: int) -> str:
    return f"c{index:07d}"


def order_key(index: int) -> str:
    return f"o{index:09d}"


KeyedBy = Literal["customer", "order"]


def encode_record(customer: str, amount: int, ts_ms: int, size: int = RECORD_BYTES,
                  filler: str = "", order: str | None = None) -> bytes:
    """One input record, padded with ``note`` to ``size`` bytes (when ``size`` allows).

    The note repeats "x" unless ``filler`` (at least as long as the padding) is given: random
    filler keeps state that stores the note from compressing to nothing. ``order``: the order
    id, carried as the first field of order-keyed records (the size stays ``size``).
    """
    head: dict[str, object] = {} if order is None else {"order": order}
    bare = orjson.dumps({**head, "customer": customer, "amount": amount, "ts": ts_ms,
                         "note": ""})
    pad = max(0, size - len(bare))
    note = filler[:pad] if len(filler) >= pad else "x" * pad
    return orjson.dumps({**head, "customer": customer, "amount": amount, "ts": ts_ms,
                         "note": note})


@dataclass
class Expected:
    """The effect a correct keyed running total (or map) has for the produced input.

    ``ordered``: a customer's records are in one partition, so every system sees them in
    produce order and each intermediate total is known. Input keyed by order id spreads a
    customer over all partitions: the order in which a system merges them is its own, so
    only order-free facts are checked (counts, final totals, and ``amount_squares``).
    """

    count: int = 0
    amount_sum: int = 0
    # Sum over all outputs of the running total they carry: catches lost and duplicated
    # outputs that happen to leave the final totals right (ordered input only).
    sum_of_totals: int = 0
    # Sum of amount² over all inputs. A correct running total's outputs step by exactly one
    # amount each, in any order, so the squares of the steps sum to this; a lost output makes
    # one step a + b ((a + b)² ≠ a² + b²), a duplicated one a step of 0.
    amount_squares: int = 0
    ordered: bool = True
    totals: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, customer: str, amount: int) -> None:
        total = self.totals.get(customer, 0) + amount
        self.totals[customer] = total
        self.counts[customer] = self.counts.get(customer, 0) + 1
        self.count += 1
        self.amount_sum += amount
        self.amount_squares += amount * amount
        self.sum_of_totals += total


def generate(records: int, keys: int, seed: int = 7) -> Iterator[tuple[str, int, int]]:
    """Deterministic (customer, amount, ts_ms) triples: uniform keys, amounts 1..100."""
    rng = random.Random(seed)
    randrange = rng.randrange
    for i in range(records):
        yield customer_key(randrange(keys)), randrange(1, 101), _BASE_TS_MS + i


def each_key_once(keys: int, seed: int = 13) -> Iterator[tuple[str, int, int]]:
    """One record per key, in key order: builds state for every key (recovery benchmark)."""
    rng = random.Random(seed)
    for i in range(keys):
        yield customer_key(i), rng.randrange(1, 101), _BASE_TS_MS + i


def producer_config(bootstrap: str, **extra: object) -> dict[str, object]:
    config: dict[str, object] = {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,  # keeps per-partition order, so per-key order
        "acks": "all",
        "linger.ms": 20,
        "batch.size": 1_000_000,
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
    }
    config.update(extra)
    return config


def _produce(producer: Producer, topic: str, key: bytes, value: bytes) -> None:
    while True:
        try:
            producer.produce(topic, value, key)
            return
        except BufferError:
            producer.poll(0.05)


def prepare_input(bootstrap: str, topic: str, rows: Iterable[tuple[str, int, int]],
                  record_bytes: int = RECORD_BYTES, random_notes: bool = False,
                  timeout: float = 300.0, keyed_by: KeyedBy = "customer") -> Expected:
    """Produce ``rows`` (from ``generate`` or ``each_key_once``) to ``topic`` (which must
    exist) and return their expected effect. ``random_notes``: incompressible padding.
    ``keyed_by="order"``: the Kafka key is the order id (the row's index, also in the value)
    instead of the customer, so a customer's records land on every partition."""
    by_order = keyed_by == "order"
    expected = Expected(ordered=not by_order)
    errors: list[str] = []

    def on_delivery(err: object, _msg: object) -> None:
        if err is not None:
            errors.append(str(err))

    producer = Producer(producer_config(bootstrap, on_delivery=on_delivery))
    rng = random.Random(5)
    for i, (customer, amount, ts_ms) in enumerate(rows):
        filler = base64.urlsafe_b64encode(rng.randbytes(record_bytes)).decode() \
            if random_notes else ""
        order = order_key(i) if by_order else None
        _produce(producer, topic, (order or customer).encode(),
                 encode_record(customer, amount, ts_ms, record_bytes, filler, order))
        expected.add(customer, amount)
        if i % 10_000 == 0:
            producer.poll(0)
    left = producer.flush(timeout)
    if left or errors:
        raise KafkaException(f"input not fully produced to {topic}: {left} undelivered, "
                             f"errors: {errors[:3]}")
    return expected


class LatencyLedger:
    """Produce time of every latency-phase record, per key in produce order.

    Per-key order is kept from input to output by every system benchmarked (the input is
    partitioned by customer and each system writes a key's outputs in order), so the n-th
    output of a key belongs to the n-th input of that key: that is how the verifier finds the
    produce time of an output that does not carry it. With input keyed by order id
    (``ordered=False``) two records of one customer on different partitions can swap places;
    the match is then off by at most the produce-time gap between the two, which is small
    exactly when such a swap can happen (both in flight at once).
    """

    def __init__(self, ordered: bool = True) -> None:
        self.sent: dict[str, list[float]] = {}
        self.measured_from = 0  # per-key ordinals below this mark are warm-up
        self.expected = Expected(ordered=ordered)
        self._warmup_done_at: float | None = None

    def record(self, customer: str, amount: int, produced_at: float) -> None:
        self.sent.setdefault(customer, []).append(produced_at)
        self.expected.add(customer, amount)

    def start_measuring(self) -> None:
        self._warmup_done_at = time.time()

    def is_measured(self, produced_at: float) -> bool:
        return self._warmup_done_at is not None and produced_at >= self._warmup_done_at

    def produced_at(self, customer: str, ordinal: int) -> float | None:
        times = self.sent.get(customer)
        if times is None or ordinal >= len(times):
            return None
        return times[ordinal]


class RateProducer:
    """Produces latency-phase records at a fixed rate from a background thread.

    Each record carries its produce time (``ts``, ms) and is recorded in the ledger *before*
    it is handed to the producer, so an output can never be seen before its input is known.
    """

    def __init__(self, bootstrap: str, topic: str, keys: int, seed: int = 11,
                 keyed_by: KeyedBy = "customer") -> None:
        self.ledger = LatencyLedger(ordered=keyed_by == "customer")
        self._by_order = keyed_by == "order"
        self._topic = topic
        self._keys = keys
        self._rng = random.Random(seed)
        self._producer = Producer(producer_config(bootstrap, **{"linger.ms": 1}))
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.produced = 0

    def produce_one(self) -> None:
        customer = customer_key(self._rng.randrange(self._keys))
        amount = self._rng.randrange(1, 101)
        now = time.time()
        self.ledger.record(customer, amount, now)
        order = order_key(self.produced) if self._by_order else None
        _produce(self._producer, self._topic, (order or customer).encode(),
                 encode_record(customer, amount, int(now * 1000), order=order))
        self._producer.poll(0)
        self.produced += 1

    def run_at_rate(self, rate: float, duration: float) -> None:
        """Start producing ``rate`` records/s for ``duration`` seconds in the background."""
        def loop() -> None:
            start = time.monotonic()
            total = int(rate * duration)
            sent = 0
            while sent < total and not self._stop.is_set():
                due = min(total, int((time.monotonic() - start) * rate) + 1)
                while sent < due:
                    self.produce_one()
                    sent += 1
                time.sleep(0.002)
            self._producer.flush(10)

        self._thread = threading.Thread(target=loop, name="rate-producer", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        self.join(5)
        self._producer.flush(10)
