"""The independent reader: a read_committed consumer of a system's output topic that times the
run from the outside and checks that every input took effect exactly once.

Runs in a thread of the harness process. ``Tally`` is the pure accounting (unit-tested);
``Verifier`` feeds it from Kafka; ``check`` turns a tally and the expected effect into a list
of problems (empty = correct).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_CREATE_TIME,
    Consumer,
    KafkaError,
    TopicPartition,
)

from benchmarks.workload import Expected, LatencyLedger


def produce_span_rate(outputs: int, first_ms: int | None, last_ms: int | None,
                      started: float, seen: float) -> float | None:
    """Records/s over the span of the outputs' produce times: Kafka's CreateTime, which the
    system's producer stamps when the system hands an output over (baseline A, B and
    Snapline's Kafka sink set no timestamp of their own). That is the processing rate without
    the start-up and without the wait for the last commit, which N / (last output seen -
    start) includes (up to a commit interval: a fifth to a third of a 3-5 s run). None when
    the stamps cannot be the system's produce times, i.e. fall outside [started - 1 s,
    seen + 1 s] (``started``, ``seen``: the run's wall-clock start and end): a system that
    copies its input's timestamp, as Quix Streams' ``to_topic`` does."""
    if first_ms is None or last_ms is None or outputs < 2 or last_ms <= first_ms:
        return None
    if first_ms < (started - 1.0) * 1000 or last_ms > (seen + 1.0) * 1000:
        return None
    return (outputs - 1) / ((last_ms - first_ms) / 1000)


#: total: outputs {"customer", "total"}; rolling: the same as a rolling aggregate emits them,
#: {"key": customer, "value": total}; map: the input's orders projected.
Mode = Literal["total", "rolling", "map", "state"]


@dataclass
class Tally:
    """What the verifier has seen so far on one output topic."""

    mode: Mode
    count: int = 0
    amount_sum: int = 0
    sum_of_totals: int = 0
    step_squares: int = 0  # sum over outputs of (total - the key's previous total)²
    out_of_order: int = 0
    undecodable: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    last_total: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    unmatched: int = 0

    def observe(self, raw: bytes | None, seen_at: float,
                ledger: LatencyLedger | None = None) -> None:
        self.count += 1
        try:
            value = orjson.loads(raw or b"")
            if self.mode == "rolling":
                value = {"customer": value["key"], "total": value["value"]}
            customer = value["customer"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            self.undecodable += 1
            return
        ordinal = self.counts.get(customer, 0)
        self.counts[customer] = ordinal + 1
        if self.mode == "map":
            self.amount_sum += value.get("amount", 0)
        else:
            total = value.get("total", 0)
            previous = self.last_total.get(customer, 0)
            if total <= previous:
                self.out_of_order += 1
            self.step_squares += (total - previous) ** 2
            self.last_total[customer] = total
            self.sum_of_totals += total
        if ledger is not None:
            produced_at = ledger.produced_at(customer, ordinal)
            if produced_at is None:
                self.unmatched += 1
            elif ledger.is_measured(produced_at):
                self.latencies.append(seen_at - produced_at)


def check(tally: Tally, expected: Expected, exactly_once: bool) -> list[str]:
    """Problems with a finished run; an empty list means the output is correct.

    Exactly-once: as many outputs as inputs, per key too, and every total right.
    At-least-once (no failures are injected, so totals must still be right): at least as many
    outputs as inputs.
    """
    problems: list[str] = []
    if tally.undecodable:
        problems.append(f"{tally.undecodable} outputs are not the expected JSON")
    if exactly_once and tally.count != expected.count:
        problems.append(f"{tally.count} outputs for {expected.count} inputs "
                        f"({tally.count - expected.count:+d})")
    if not exactly_once and tally.count < expected.count:
        problems.append(f"only {tally.count} outputs for {expected.count} inputs")
    missing_keys = [k for k, n in expected.counts.items() if tally.counts.get(k, 0) < n]
    if missing_keys:
        problems.append(f"{len(missing_keys)} keys have fewer outputs than inputs, e.g. "
                        f"{missing_keys[0]}")
    if exactly_once:
        extra = [k for k, n in tally.counts.items() if expected.counts.get(k, 0) != n]
        if extra and not missing_keys:
            problems.append(f"{len(extra)} keys have more outputs than inputs, e.g. {extra[0]}")
    if tally.mode == "map":
        if exactly_once and tally.amount_sum != expected.amount_sum:
            problems.append(f"sum of amounts {tally.amount_sum} != {expected.amount_sum}")
        return problems
    wrong = [k for k, t in expected.totals.items() if tally.last_total.get(k) != t]
    if wrong:
        k = wrong[0]
        problems.append(f"{len(wrong)} keys end with a wrong total, e.g. {k}: "
                        f"{tally.last_total.get(k)} != {expected.totals[k]}")
    if tally.out_of_order and exactly_once:
        problems.append(f"{tally.out_of_order} totals did not increase (reordered or replayed)")
    if exactly_once and not wrong:
        if expected.ordered and tally.sum_of_totals != expected.sum_of_totals:
            problems.append(f"sum of all output totals {tally.sum_of_totals} != "
                            f"{expected.sum_of_totals} (lost or duplicated intermediate outputs)")
        if tally.step_squares != expected.amount_squares:
            problems.append(f"sum of squared steps between a key's totals {tally.step_squares} "
                            f"!= sum of squared amounts {expected.amount_squares} (lost or "
                            "duplicated intermediate outputs)")
    return problems


def verifier_config(bootstrap: str, group: str) -> dict[str, object]:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,  # required by librdkafka; offsets are never committed
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
        "auto.offset.reset": "earliest",
        "fetch.wait.max.ms": 10,  # an output becomes visible to us within ~10 ms
        "enable.partition.eof": False,
        # librdkafka's default 1 s fetch queue backoff capped this reader at ~190k records/s,
        # and with it every system's measured rate (baselines.py).
        "fetch.queue.backoff.ms": 10,
    }


class Verifier:
    """Reads ``topic`` from the beginning in a background thread until stopped."""

    def __init__(self, bootstrap: str, topic: str, partitions: int, mode: Mode,
                 ledger: LatencyLedger | None = None,
                 on_output: Callable[[bytes | None, float], None] | None = None) -> None:
        """``on_output(value, seen_at)``: called in the reading thread for every output,
        after it is tallied (the handover benchmark times outputs per input partition)."""
        self.tally = Tally(mode)
        self._on_output = on_output
        self.errors: list[str] = []
        self.first_seen_at: float | None = None
        self.last_seen_at: float | None = None
        #: Earliest and latest CreateTime (ms) of the outputs (``produce_span_rate``).
        self.first_created_ms: int | None = None
        self.last_created_ms: int | None = None
        self._ledger = ledger
        self._topic = topic
        self._partitions = partitions
        self._consumer = Consumer(verifier_config(bootstrap, f"verifier-{topic}"))
        self._consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING)
                               for p in range(partitions)])
        self._lock = threading.Lock()
        #: Passes of the reading loop begun (``drain``: a batch consumed is also tallied).
        self._passes = 0
        self._reached: list[tuple[int, threading.Event, list[float]]] = []
        self._stop = threading.Event()
        #: Calls on the consumer asked of the reading thread (``_ask``).
        self._asks: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name=f"verifier-{topic}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ reading
    def _loop(self) -> None:
        consume = self._consumer.consume
        observe = self.tally.observe
        ledger = self._ledger
        on_output = self._on_output
        try:
            while not self._stop.is_set():
                self._passes += 1
                messages = consume(num_messages=10_000, timeout=0.05)
                self._serve_asks()
                if not messages:
                    continue
                now = time.time()
                with self._lock:
                    for msg in messages:
                        err = msg.error()
                        if err is not None:
                            if err.code() != KafkaError._PARTITION_EOF:
                                self.errors.append(str(err))
                            continue
                        observe(msg.value(), now, ledger)
                        kind, created = msg.timestamp()
                        if kind == TIMESTAMP_CREATE_TIME:
                            if self.first_created_ms is None or created < self.first_created_ms:
                                self.first_created_ms = created
                            if self.last_created_ms is None or created > self.last_created_ms:
                                self.last_created_ms = created
                        if on_output is not None:
                            on_output(msg.value(), now)
                    if self.first_seen_at is None:
                        self.first_seen_at = now
                    self.last_seen_at = now
                    self._signal(now)
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed silently
            self.errors.append(f"verifier crashed: {exc!r}")
        finally:
            self._consumer.close()

    def _serve_asks(self) -> None:
        while not self._asks.empty():
            fn, box, done = self._asks.get_nowait()
            try:
                box.append((True, fn()))
            except Exception as exc:  # noqa: BLE001 - handed to the thread that asked
                box.append((False, exc))
            done.set()

    def _ask(self, fn: Callable[[], Any], timeout: float) -> Any:
        """``fn()`` (a call on the consumer) run by the reading thread between two of its
        consume calls; raises TimeoutError if it did not run within ``timeout``. Only that
        thread touches the consumer: from confluent-kafka 2.16 a Consumer admits one thread
        at a time, and a call from another thread waited for a gap between the reading
        thread's back-to-back consume calls that it never found (a drain hung)."""
        box: list[Any] = []
        done = threading.Event()
        self._asks.put((fn, box, done))
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):  # a reading thread that ended answers nobody
            if not self._thread.is_alive() or time.monotonic() >= deadline:
                raise TimeoutError("the verifier's reading thread did not answer")
        ok, value = box[0]
        if ok:
            return value
        raise value

    def _signal(self, now: float) -> None:
        for target, event, when in self._reached:
            if not event.is_set() and self.tally.count >= target:
                when.append(now)
                event.set()

    # ------------------------------------------------------------------ waiting
    def steady_records_per_s(self, outputs: int, started: float, seen: float) -> float | None:
        """``produce_span_rate`` of what was read so far."""
        with self._lock:
            first, last = self.first_created_ms, self.last_created_ms
        return produce_span_rate(outputs, first, last, started, seen)

    @property
    def count(self) -> int:
        return self.tally.count

    def wait_for(self, target: int, timeout: float, stall_timeout: float,
                 still_running: Callable[[], bool] | None = None) -> tuple[float | None, str]:
        """Wait until ``target`` outputs were seen; return (time seen, "" or why not).

        Gives up after ``timeout`` seconds, after ``stall_timeout`` seconds without a new
        output, or as soon as ``still_running()`` says the system's process is gone.
        """
        event = threading.Event()
        when: list[float] = []
        with self._lock:
            self._reached.append((target, event, when))
            self._signal(time.time())
        deadline = time.monotonic() + timeout
        last_count, last_progress = -1, time.monotonic()
        while not event.wait(0.1):
            now = time.monotonic()
            if self.count != last_count:
                last_count, last_progress = self.count, now
            if now > deadline:
                return None, f"timed out after {timeout:.0f}s with {self.count}/{target} outputs"
            if now - last_progress > stall_timeout:
                return None, (f"no new output for {stall_timeout:.0f}s "
                              f"({self.count}/{target} outputs)")
            if still_running is not None and not still_running():
                event.wait(1.0)  # its last transaction may just have become visible
                if event.is_set():
                    break
                return None, f"the system's process exited with {self.count}/{target} outputs"
            if not self._thread.is_alive():
                return None, "; ".join(self.errors) or "verifier stopped"
        return when[0], ""

    def drain(self, quiet: float = 1.5, timeout: float = 20.0) -> bool:
        """After the system stopped: read on until every partition is read to its end as it
        is now, or else until nothing new arrives for ``quiet`` seconds, so late duplicates
        are counted. False if output kept arriving for ``timeout``.

        The system is gone, so nothing is written after the ends are read: a transaction it
        committed whose markers are not written yet holds this reader below its end until
        they are, and one left open (the quiet rule then ends the wait) holds it there."""
        deadline = time.monotonic() + timeout
        ends = self._ends()
        last_count, quiet_since = self.count, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if ends is not None and self._read_to(ends):
                # The pass that consumed the last outputs tallies them before the next one.
                current = self._passes
                while self._passes <= current and self._thread.is_alive():
                    time.sleep(0.01)
                return True
            if self.count != last_count:
                last_count, quiet_since = self.count, time.monotonic()
            elif time.monotonic() - quiet_since >= quiet:
                return True
        return False

    def _ends(self) -> list[int] | None:
        """Each partition's end (high watermark) now, or None if a broker did not say."""
        try:
            return self._ask(
                lambda: [
                    self._consumer.get_watermark_offsets(
                        TopicPartition(self._topic, p), timeout=5, cached=False
                    )[1]
                    for p in range(self._partitions)
                ],
                timeout=5.0 * self._partitions + 5,
            )
        except Exception:  # noqa: BLE001 - the quiet rule still ends the drain
            return None

    def _read_to(self, ends: list[int]) -> bool:
        """Whether the reader's position reached ``ends`` in every partition (a
        read_committed position moves past transaction markers)."""
        try:
            positions = self._ask(
                lambda: self._consumer.position(
                    [TopicPartition(self._topic, p) for p in range(self._partitions)]
                ),
                timeout=5.0,
            )
        except Exception:  # noqa: BLE001 - the consumer is closing: the quiet rule decides
            return False
        return all(end <= 0 or tp.offset >= end for tp, end in zip(positions, ends, strict=True))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
