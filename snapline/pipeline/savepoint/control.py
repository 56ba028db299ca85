"""The control channel: how ``snapline savepoint create`` reaches every worker of a running job.

Requests are JSON records on the job's control topic ``<job>.control`` (one partition, created
when missing): ``{"id", "action": "savepoint", "stop"}`` and ``{"id", "action": "resume"}``.
Every worker reads it from the end it finds at start (asked of the broker before the worker
joins its group, so no request sent to a member is missed). On a savepoint request a worker
commits a checkpoint of everything read so far, then pauses reading (or, with ``stop``, exits)
and acknowledges by writing ``<job>/savepoints/_requests/<id>/<worker>.json`` to checkpoint storage;
the CLI writes the savepoint from the committed checkpoints once every member has
acknowledged, then sends ``resume`` (with ``stop`` too: it closes the request). A worker
that starts while a request without ``stop`` is in progress (no ``resume`` yet, the CLI heard
from within 1.5 × ``HOLD_EVERY``) finds it at start and takes part
(``ControlChannel._in_progress``). A paused worker resumes by itself after
``PAUSE_LIMIT`` seconds without hearing from the CLI, so a CLI that died never stalls a job
for long; while it writes the savepoint the CLI sends ``{"id", "action": "hold"}`` every
``HOLD_EVERY`` seconds (``holding``), so an export that takes longer keeps the job paused,
for ``MAX_PAUSE`` seconds at most.

Threads: a worker polls on its main thread; the CLI on its own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from confluent_kafka import (
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError

log = logging.getLogger(__name__)

#: A paused worker resumes by itself after this many seconds without a "resume" or "hold".
PAUSE_LIMIT = 300.0
#: How often the CLI tells paused workers to stay paused while it writes the savepoint.
HOLD_EVERY = PAUSE_LIMIT / 5
#: The longest holds keep a worker paused (a CLI whose export hangs never stalls a job for
#: good); the savepoint then fails its check of the group's offsets.
MAX_PAUSE = 3600.0


def control_topic(job: str) -> str:
    return f"{job}.control"


def ack_directory(job: str, request_id: str) -> str:
    return f"{job}/savepoints/_requests/{request_id}"


#: Records of the control topic a starting worker reads back for a savepoint in progress.
LOOKBACK = 200


@dataclass(frozen=True)
class Request:
    id: str
    action: str
    stop: bool = False
    #: A request found in progress at start: when the CLI last spoke of it (monotonic time,
    #: what its pause counts from); None for a request heard as it came.
    heard: float | None = None


def ensure_control_topic(kafka_config: dict[str, Any], job: str) -> None:
    topic = control_topic(job)
    admin = AdminClient(kafka_config)
    if topic in admin.list_topics(timeout=30).topics:
        return
    try:
        admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=-1)])[
            topic
        ].result(timeout=35)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        meta = admin.list_topics(topic, timeout=10).topics.get(topic)
        if (
            meta is not None
            and meta.error is None
            and all(p.leader >= 0 for p in meta.partitions.values())
        ):
            return
        time.sleep(0.2)


class ControlChannel:
    """A worker's reader of the control topic (no consumer group: every worker reads all)."""

    def __init__(
        self, kafka_config: dict[str, Any], job: str, pause_limit: float = PAUSE_LIMIT
    ) -> None:
        ensure_control_topic(kafka_config, job)
        self._consumer = Consumer(
            {
                **kafka_config,
                "group.id": f"{job}.control-reader",  # never subscribes or commits
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        topic = control_topic(job)
        end = self._end(job)
        #: Records below it were sent before this worker started: never taken as requests.
        self._live_from = -1 if end == OFFSET_END else end
        start = end
        if end != OFFSET_END:
            try:
                low = self._consumer.get_watermark_offsets(
                    TopicPartition(topic, 0), timeout=10, cached=False
                )[0]
                start = max(low, end - LOOKBACK, 0)
            except KafkaException as exc:
                log.warning("control topic %s: could not read it back (%s)", topic, exc)
        # Assigned once: assigned again, the partition's fetcher can abort the process at
        # close (rd_kafka_assignment_partition_stopped: rktp_started, seen in a test).
        self._consumer.assign([TopicPartition(topic, 0, start)])
        #: A savepoint in progress when this worker started: the first poll returns it.
        self._pending: list[Request] = []
        #: Live records the read-back consumed with the old ones (the first poll has them).
        self._early: list[Any] = []
        if start < end:
            try:
                self._pending = self._in_progress(end, pause_limit)
            except KafkaException as exc:
                log.warning("control topic %s: could not read it back (%s)", topic, exc)
        self._last_poll = 0.0

    def _in_progress(self, end: int, pause_limit: float) -> list[Request]:
        """The savepoint request sent before this worker started that is still in progress:
        no ``resume`` for it since (the CLI sends one when it is done, --stop too), and its
        last record (the request, or a ``hold``, which a live CLI sends every HOLD_EVERY)
        younger than 1.5 × HOLD_EVERY (at most ``pause_limit``). A worker started while
        ``snapline savepoint create`` waited for acknowledgements (restarted after a crash,
        or a new member) never heard the request: the CLI waited its whole timeout for it,
        or failed on the tasks it took over. A ``stop`` request is not joined: taken for
        in progress by mistake (its CLI died before its ``resume``), it would end a job just
        restarted, where a pause ends by itself."""
        open_: dict[str, tuple[Request, int]] = {}  # id -> (request, last record's time, ms)
        deadline = time.monotonic() + 10
        seen = -1
        while seen < end and time.monotonic() < deadline:
            for msg in self._consumer.consume(LOOKBACK, 0.5):
                if msg.error() is not None:
                    continue
                seen = msg.offset() + 1
                if msg.offset() >= end:  # sent since this worker started: a live one
                    self._early.append(msg)
                    continue
                request = _parse(msg.value())
                if request is None:
                    continue
                sent = msg.timestamp()[1]
                if request.action == "savepoint" and not request.stop:
                    open_[request.id] = (request, sent)
                elif request.action == "hold" and request.id in open_:
                    open_[request.id] = (open_[request.id][0], sent)
                elif request.action == "resume":
                    open_.pop(request.id, None)
        now_ms = time.time() * 1000
        fresh_ms = min(pause_limit, 1.5 * HOLD_EVERY) * 1000
        young = [(sent, r) for r, sent in open_.values() if now_ms - sent < fresh_ms]
        if not young:
            return []
        sent, request = max(young, key=lambda found: found[0])
        age = max(0.0, (now_ms - sent) / 1000)
        log.info(
            "savepoint %s was requested before this worker started and is in progress (last "
            "heard of %.0f s ago): it takes part",
            request.id,
            age,
        )
        return [Request(request.id, request.action, request.stop, time.monotonic() - age)]

    def _end(self, job: str) -> int:
        """The control topic's end offset, asked of the broker now. Assigned at ``OFFSET_END``
        the consumer would resolve the end only when it first fetches, which can come after a
        request sent right after this worker joined its group (measured: a request produced
        just after ``assign`` was never read); the CLI then waited its whole timeout for an
        acknowledgement that could not come."""
        tp = TopicPartition(control_topic(job), 0)
        deadline = time.monotonic() + 30
        while True:
            try:
                return int(self._consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1])
            except KafkaException as exc:
                if time.monotonic() > deadline:
                    log.warning(
                        "control topic %s: end offset unknown (%s); reading from the end "
                        "found at the first fetch",
                        tp.topic,
                        exc,
                    )
                    return OFFSET_END
                time.sleep(0.5)

    def poll(self, every: float = 0.2) -> list[Request]:
        now = time.monotonic()
        if now - self._last_poll < every:
            return []
        self._last_poll = now
        requests, self._pending = self._pending, []
        messages, self._early = self._early + self._consumer.consume(10, 0), []
        for msg in messages:
            if msg.error() is not None or msg.offset() < self._live_from:
                continue
            request = _parse(msg.value())
            if request is not None:
                requests.append(request)
        return requests

    def close(self) -> None:
        with contextlib.suppress(KafkaException):
            self._consumer.close()


def _parse(value: bytes | None) -> Request | None:
    try:
        body = orjson.loads(value or b"")
        return Request(str(body["id"]), str(body["action"]), bool(body.get("stop")))
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        log.warning("ignoring a malformed control record: %s", exc)
        return None


def send(
    kafka_config: dict[str, Any], job: str, action: str, request_id: str, stop: bool = False
) -> None:
    producer = Producer(kafka_config)
    producer.produce(
        control_topic(job), orjson.dumps({"id": request_id, "action": action, "stop": stop})
    )
    if producer.flush(30):
        raise CheckpointError(f"could not send {action!r} to {control_topic(job)}")


@contextlib.contextmanager
def holding(
    kafka_config: dict[str, Any], job: str, request_id: str, every: float = HOLD_EVERY
) -> Iterator[None]:
    """Send ``hold`` for ``request_id`` every ``every`` seconds while the block runs (a
    thread): the paused workers' ``PAUSE_LIMIT`` starts again at each. A hold that cannot
    be sent is logged; the export's own check then finds a job that resumed. One producer
    sends them all: a new one per hold (its connection, its metadata, its destruction) made
    holds late on a loaded machine, by seconds, and a worker with a short limit resumed."""
    stop = threading.Event()
    hold = orjson.dumps({"id": request_id, "action": "hold", "stop": False})

    def run() -> None:
        producer: Producer | None = None
        while not stop.wait(every):
            try:
                if producer is None:
                    producer = Producer(kafka_config)
                producer.produce(control_topic(job), hold)
                if producer.flush(30):
                    raise CheckpointError(f"could not send 'hold' to {control_topic(job)}")
            except (CheckpointError, KafkaException) as exc:
                log.warning("could not tell the workers to stay paused: %s", exc)

    thread = threading.Thread(target=run, name="savepoint-hold", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=35)


def new_request_id() -> str:
    return uuid.uuid4().hex[:12]


def write_ack(
    storage: CheckpointStorage, job: str, request_id: str, worker: str, body: dict[str, Any]
) -> None:
    storage.write_bytes(
        f"{ack_directory(job, request_id)}/{worker}.json",
        orjson.dumps({**body, "worker": worker, "time": time.time()}),
    )


def read_acks(storage: CheckpointStorage, job: str, request_id: str) -> dict[str, dict[str, Any]]:
    directory = ack_directory(job, request_id)
    acks = {}
    for name in storage.list_dir(directory):
        if name.endswith(".json"):
            acks[name[:-5]] = orjson.loads(storage.read_bytes(f"{directory}/{name}"))
    return acks
