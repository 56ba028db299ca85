"""The executor side of ``snapline spark stream``: the part before ``key_by`` as an Arrow map
over each micro-batch, and the keyed part as a ``transformWithState`` stateful processor whose
keyed state lives in Spark's state store (RocksDB).

State mapping: Snapline's state types sit on a ``KeyedStateBackend``; here that backend is
``SparkKeyedState``, which puts every Snapline state of the current key into Spark state
variables of the grouping key: a ``MapState`` becomes a Spark ``MapState`` (binary user key →
binary value, one Spark entry per entry); ``ValueState``, ``ListState``, ``ReducingState`` and
``AggregatingState`` each become one Spark ``ValueState`` holding the bytes Snapline's backends
hold (the descriptor's serde; a list as one value). TTL stays Snapline's (an expiry stamp in the
bytes) with the micro-batch's timestamp as processing time, so a re-run batch sees the same
clock. Value states are read once per key and batch and written back at the end of the key's
rows. Event-time timers (``ctx.timers``) are Spark timers of the grouping key
(``SparkTimers``); a window is Snapline's ``WindowOperator`` over ``SparkKeyedState`` with
those timers, its results coming out of ``handleExpiredTimer``.

Rows cross Spark as pickled Python values (Spark pickles Python rows between its workers
anyway; they live for one batch and never reach checkpoint storage) plus their source position,
which orders a key's rows the way a service task reads them (offset order per partition).

Threads: Spark's Python workers run everything here, one key (or one Arrow batch) at a time.
"""

from __future__ import annotations

import copy
import heapq
import pickle
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import ConfigurationError, StateError
from snapline.pipeline.formats import decoder, encode_key, tag_key, untag_key
from snapline.pipeline.functions import Context
from snapline.pipeline.spark.stream_plan import CO_SIDES, StreamPlan, plan_stream, run_chain
from snapline.pipeline.state.backend import KeyedStateBackend, SnapshotHandle, StateHandle
from snapline.pipeline.state.descriptors import KeyScope
from snapline.pipeline.state.timers import TimerState
from snapline.pipeline.time import timestamp_ms

#: Rows into the keyed part (grouped by ``key``, a tagged key; dead letters of the first part
#: are grouped under DEAD_KEY, and its outputs to sinks (``sink``, with the record's own
#: tagged key in ``out_key``) under PASS_PREFIX + the input partition: both only pass through).
KEYED_SCHEMA = (
    "key binary, topic string, partition int, offset long, seq int, ts long, value binary, "
    "raw binary, raw_key binary, reason string, now long, sink int, out_key binary, entry int, "
    "tkey binary"
)
#: With several key_bys, keyed rows are grouped by SHARED_KEY_TAG + the key's bytes (``tkey``
#: holds each row's tagged key): as on the services, whose state is scoped by the key's bytes,
#: a key 17 of one side and "17" of the other meet (grouped by the tagged key, a join of them
#: never matched). One key_by keeps the tagged key: the grouping of a running query's state.
SHARED_KEY_TAG = b"k"
#: The Spark value state holding a shared key's last tagged key (``ctx.key`` of its timers).
SHARED_KEY_STATE = "_snapline_key"
#: Rows to the sinks: ``sink`` indexes StreamPlan.sinks, -1 is a dead letter (``value`` then
#: holds the bytes to send and ``reason`` why).
OUT_SCHEMA = (
    "sink int, topic string, partition int, offset long, seq int, n int, ts long, key binary, "
    "value binary, raw_key binary, reason string, pos long"
)
#: ``pos`` of the keyed part's outputs: where their input ran among its key's rows of the batch
#: (``interleaved``), a timer's after them (TIMER_POS + its time); None for the other rows.
#: The commit writes a key's outputs in that order (``output_order``).
TIMER_POS = 1 << 50
OUT_FIELDS = tuple(f.split()[0] for f in OUT_SCHEMA.split(", "))
_KEY, _POS = OUT_FIELDS.index("key"), OUT_FIELDS.index("pos")
DEAD_KEY = b"!dead-letters"
#: Groups of the first part's sink outputs, one per input partition (spread over the state
#: partitions; no state is kept for them).
PASS_PREFIX = b"!pass:"
#: The event-time clock of a query with timers: each Arrow batch of the first part adds one row
#: (key CLOCK_KEY, seq CLOCK_SEQ) whose ``ts`` is the largest event time of its records, and
#: only these rows carry the watermark column (``stream.event_time_column``). Spark drops any
#: input row of a stateful operator whose watermark column is behind the watermark, before the
#: processor sees it; the other rows have none (null), so no record is dropped: late records
#: reach the keyed part, which decides about them as a service task does (a window's allowed
#: lateness and late-record dead letters, a process function sees every record).
CLOCK_KEY = b"!clock"
CLOCK_SEQ = -1


def spark_state_name(uid: str, name: str) -> str:
    """A Snapline state's Spark state variable name (stable: operator uid and state name)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", f"{uid}__{name}")


class SparkKeyedState(KeyedStateBackend):
    """A KeyedStateBackend over the Spark state variables of the current grouping key (see
    module). Stored keys end with the state id, the only part used: Spark scopes state to the
    grouping key itself."""

    name = "spark"

    def __init__(self, values: dict[int, Any], maps: dict[int, Any]) -> None:
        self._values = values
        self._maps = maps
        self._cache: dict[int, bytes | None] = {}
        self._dirty: set[int] = set()

    def _value_state(self, sid: int) -> Any:
        try:
            return self._values[sid]
        except KeyError:
            raise StateError(f"state id {sid} has no Spark value state") from None

    def get(self, key: bytes) -> bytes | None:
        sid = key[-1]
        if sid not in self._cache:
            row = self._value_state(sid).get()
            self._cache[sid] = None if row is None else bytes(row[0])
        return self._cache[sid]

    def put(self, key: bytes, value: bytes) -> None:
        self._value_state(key[-1])
        self._cache[key[-1]] = value
        self._dirty.add(key[-1])

    def delete(self, key: bytes) -> None:
        self.put(key, None)  # type: ignore[arg-type]

    def flush(self) -> None:
        """The current key is done: write back changed values, forget the cache."""
        for sid in self._dirty:
            value = self._cache[sid]
            if value is None:
                self._values[sid].clear()
            else:
                self._values[sid].update((value,))
        self._cache.clear()
        self._dirty.clear()

    def map_get(self, prefix: bytes, user_key: bytes) -> bytes | None:
        row = self._maps[prefix[-1]].getValue((user_key,))
        return None if row is None else bytes(row[0])

    def map_put(self, prefix: bytes, user_key: bytes, value: bytes) -> None:
        self._maps[prefix[-1]].updateValue((user_key,), (value,))

    def map_delete(self, prefix: bytes, user_key: bytes) -> None:
        self._maps[prefix[-1]].removeKey((user_key,))

    def map_items(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        items = [(bytes(k[0]), bytes(v[0])) for k, v in self._maps[prefix[-1]].iterator()]
        return iter(items)

    def map_clear(self, prefix: bytes) -> None:
        self._maps[prefix[-1]].clear()

    def snapshot(self, checkpoint_id: int) -> SnapshotHandle:
        raise StateError("Spark's state store checkpoints this state, not Snapline")

    def restore(self, handle: StateHandle, storage: CheckpointStorage) -> None:
        raise StateError("Spark's state store restores this state, not Snapline")

    def items(self) -> Iterator[tuple[bytes, bytes | None, bytes]]:
        raise StateError("Spark's state store holds this state; it cannot be listed")


def _functions(pipeline: Any, steps: Iterable[Any]) -> list[Any]:
    by_id = {n.id: n for n in pipeline.nodes}
    return [by_id[s.node_id].fn for s in steps]


def _dead(reason: str, fail: bool, where: str) -> str:
    from snapline.pipeline.runtime.task import UserCodeError

    if fail:
        raise UserCodeError(
            f"{reason} at {where} (pipeline on_error='fail'; use on_error='dead_letter' to "
            "divert such records)"
        )
    return reason


def first_part(spec: str) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The Arrow map of the part before ``key_by``: decodes each Kafka record, runs the chain,
    and emits keyed rows (KEYED_SCHEMA), or sink rows (OUT_SCHEMA) for a pipeline without
    ``key_by``."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from snapline.pipeline.graph import load_pipeline

        pipeline = load_pipeline(spec)
        part = _FirstPart(pipeline, plan_stream(pipeline))
        ddl = KEYED_SCHEMA if part.keyed else OUT_SCHEMA
        arrow_types = {"binary": pa.binary(), "string": pa.string(), "int": pa.int32()}
        schema = pa.schema(
            [(f.split()[0], arrow_types.get(f.split()[1], pa.int64())) for f in ddl.split(", ")]
        )
        clock = part.keyed and part.plan.timed is not None
        for batch in batches:
            part.max_ts = None
            cols = batch.to_pydict()
            out: dict[str, list[Any]] = {name: [] for name in schema.names}
            for record in zip(
                cols["topic"],
                cols["partition"],
                cols["offset"],
                cols["key"],
                cols["value"],
                cols["ts"],
                cols["now"],
                strict=True,
            ):
                for row in part.rows(*record):
                    for name in schema.names:
                        out[name].append(row.get(name))
            if clock and part.max_ts is not None:
                tick = {"key": CLOCK_KEY, "seq": CLOCK_SEQ, "ts": part.max_ts}
                for name in schema.names:
                    out[name].append(tick.get(name))
            yield pa.RecordBatch.from_pydict(out, schema=schema)

    return run


class _FirstPart:
    """The part before ``key_by`` for one Kafka record at a time."""

    def __init__(self, pipeline: Any, plan: StreamPlan) -> None:
        by_id = {n.id: n for n in pipeline.nodes}
        self.plan = plan
        self.fns = _functions(pipeline, plan.pre)
        self.keyed = plan.key_by is not None
        #: Each key_by's key function (None: the record's own key) and name.
        self.key_fns = [by_id[k].fn for k in plan.key_bys]
        self.shared_keys = len(plan.key_bys) > 1
        self.key_names = [by_id[k].name for k in plan.key_bys]
        #: Per source topic: the value and key decoders, the timestamp function and the step
        #: of ``plan.pre`` its records start at (its source's).
        self.by_topic: dict[str, tuple[Any, Any, Any, int]] = {
            topic: (
                decoder(src.value_format),
                decoder(src.key_format),
                src.timestamp,
                root,
            )
            for src, root in zip(plan.sources, plan.roots, strict=True)
            for topic in src.topic_list
        }
        self.fail = pipeline.on_error == "fail"
        self.names = [by_id[s.node_id].name for s in plan.pre]
        #: The record's own key is encoded for these only (without key_by, every sink is one).
        self.sinks_before_key_by = any(s.sinks for s in plan.pre)
        #: The largest event time of the decodable records since the caller reset it (what
        #: moves the watermark, as in a service task: filtered records too).
        self.max_ts: int | None = None

    def rows(
        self,
        topic: str,
        partition: int,
        offset: int,
        raw_key: bytes | None,
        raw: bytes | None,
        kafka_ts: int,
        now: int,
    ) -> list[dict[str, Any]]:
        where = f"{topic}[{partition}]@{offset}"
        position = {"topic": topic, "partition": partition, "offset": offset, "raw_key": raw_key}
        #: With key_by: what goes on to it (group, pickled value, which key_by, tagged key).
        keyed: list[tuple[bytes, bytes, int, bytes]] = []
        #: Outputs to sinks of the part before key_by (pickled value, sink, the record's own
        #: tagged key, as in a service task).
        sunk: list[tuple[bytes, int, bytes | None]] = []
        #: Operators that raised for this record: each a dead letter, as in a service task
        #: (what they yielded before raising is dropped; the other values go on).
        failures: list[str] = []
        ts = kafka_ts

        def on_error(step: int, exc: Exception) -> None:
            failures.append(_dead(f"{where}: {self.names[step]} raised {exc!r}", self.fail, where))

        found = self.by_topic.get(topic)
        if found is None:
            raise ConfigurationError(
                f"the query read a record of topic {topic!r}, which no source of the pipeline "
                "reads now (a source removed from the pipeline of a running query?): a query's "
                "sources are fixed by its checkpoint location; start the changed pipeline with "
                "a new --checkpoint-location"
            )
        decode_value, decode_key, timestamp, root = found
        try:
            value, key = decode_value(raw), decode_key(raw_key)
            if timestamp is not None:
                ts = timestamp_ms(timestamp(value))
        except Exception as exc:  # the record itself is bad: nothing of it runs
            failures.append(_dead(f"{where}: {exc!r}", self.fail, where))
        else:
            if self.max_ts is None or ts > self.max_ts:
                self.max_ts = ts
            tagged = None
            if self.sinks_before_key_by:
                kb = encode_key(key)
                tagged = None if kb is None else tag_key(key, kb)

            def to_sink(sink: int, v: Any) -> None:
                try:
                    sunk.append((pickle.dumps(v), sink, tagged))
                except Exception as exc:
                    failures.append(_dead(f"{where}: cannot pickle {exc!r}", self.fail, where))

            def to_key(v: Any, entry: int) -> None:
                key_fn = self.key_fns[entry]
                try:
                    k = key if key_fn is None else key_fn(v)
                    kb = encode_key(k)
                    if kb is None:
                        raise ValueError("key_by returned None as the key")
                    tagged_key = tag_key(k, kb)
                    group = SHARED_KEY_TAG + kb if self.shared_keys else tagged_key
                    keyed.append((group, pickle.dumps(v), entry, tagged_key))
                except Exception as exc:
                    reason = f"{where}: {self.key_names[entry]} raised {exc!r}"
                    failures.append(_dead(reason, self.fail, where))

            run_chain(
                self.plan.pre,
                self.fns,
                value,
                None,
                to_sink,
                to_key if self.keyed else None,
                start=root,
                on_error=on_error,
            )
        rows: list[dict[str, Any]]
        if self.keyed:
            rows = [
                {**position, "key": k, "seq": seq, "ts": ts, "value": v}
                | {"raw": raw, "now": now, "entry": entry, "tkey": tk}
                for seq, (k, v, entry, tk) in enumerate(keyed)
            ]
            group = PASS_PREFIX + b"%d" % partition
            rows += [
                {**position, "key": group, "seq": len(rows) + n, "ts": ts, "value": v}
                | {"sink": sink, "out_key": out_key, "now": now}
                for n, (v, sink, out_key) in enumerate(sunk)
            ]
            return rows + [
                {**position, "key": DEAD_KEY, "seq": len(rows) + n, "ts": kafka_ts, "raw": raw}
                | {"reason": reason, "now": now}
                for n, reason in enumerate(failures)
            ]
        rows = [
            {**position, "sink": sink, "seq": 0, "n": n, "ts": ts, "key": k} | {"value": v}
            for n, (v, sink, k) in enumerate(sunk)
        ]
        return rows + [
            {**position, "sink": -1, "seq": 0, "n": len(rows) + n, "ts": kafka_ts, "value": raw}
            | {"reason": reason}
            for n, reason in enumerate(failures)
        ]


class UnmappedTimerError(StateError):
    """A processing-time timer on Spark: fails the query (never a dead letter)."""


class SparkTimers:
    """The ``TimerService`` API (``ctx.timers``) over Spark's event-time timers of the current
    grouping key. Processing-time timers are not mapped: registering one fails with a message
    (Spark runs a query's timers in one time mode)."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.watermark = -(1 << 63)
        self.now = 0

    def current_watermark(self) -> int:
        return self.watermark

    def current_processing_time(self) -> int:
        return self.now

    def register_event_time(self, timestamp: int) -> None:
        if not isinstance(timestamp, int) or isinstance(timestamp, bool):
            raise TypeError(f"timer timestamp {timestamp!r} must be int milliseconds")
        self._handle.registerTimer(timestamp)

    def delete_event_time(self, timestamp: int) -> None:
        self._handle.deleteTimer(timestamp)

    def register_processing_time(self, timestamp: int) -> None:
        raise UnmappedTimerError(
            "processing-time timers are not mapped onto Spark (the query runs its timers in "
            "event time); use event-time timers or run the pipeline as services"
        )

    def delete_processing_time(self, timestamp: int) -> None:
        self.register_processing_time(timestamp)


class _WindowTask:
    """What a WindowOperator uses of its task, inside Spark: the watermark, the clock and the
    dead letters of the record being processed (late records)."""

    def __init__(self, task_id: str, fail: bool) -> None:
        self.task_id = task_id
        self.epoch = 0
        self.watermark = -(1 << 63)
        self.sink_results: dict[str, Any] = {}
        self.fail = fail
        self.dead: list[str] = []
        self.now = 0

    def now_ms(self) -> int:
        return self.now

    def dead_letter(self, record: Any, reason: str, value: bytes | None = None) -> None:
        where = f"{record.topic}[{record.partition}]@{record.offset}"
        self.dead.append(_dead(reason, self.fail, where))


def _window_step(op: Any, collected: list[Any], ctx: Context, keys: dict[str, Any]) -> Any:
    """A chain step function that runs one value through a WindowOperator."""
    from snapline.pipeline.record import Record

    def push(value: Any) -> list[Any]:
        record = Record(
            value,
            ctx.timestamp,
            ctx.topic,
            ctx.partition,
            ctx.offset,
            ctx.key,
            keys["bytes"],
            keys["group"],
        )
        op.process([record])
        out = [r.value for r in collected]
        collected.clear()
        return out

    return push


def keyed_processor(spec: str) -> Any:
    """A ``StatefulProcessor`` running the keyed part of ``spec`` (see module)."""
    from pyspark.sql import Row
    from pyspark.sql.streaming import StatefulProcessor

    from snapline.pipeline.keygroups import state_key_prefix
    from snapline.pipeline.runtime.operators import Operator
    from snapline.pipeline.runtime.window_operator import WindowOperator
    from snapline.pipeline.windows import SlidingWindows

    class _Collect(Operator):
        def __init__(self, task: Any, into: list[Any]) -> None:
            super().__init__(task, "collect")
            self.into = into

        def process(self, records: list[Any]) -> None:
            self.into.extend(records)

    class KeyedChain(StatefulProcessor):
        def init(self, handle: Any) -> None:
            from snapline.pipeline.graph import load_pipeline

            pipeline = load_pipeline(spec)
            plan: StreamPlan = plan_stream(pipeline)
            self.plan = plan
            self.fail = pipeline.on_error == "fail"
            self.maxp = pipeline.max_parallelism
            uids = pipeline.operator_uids()
            state_ids = pipeline.state_ids()
            values: dict[int, Any] = {}
            maps: dict[int, Any] = {}
            stateful = list(
                dict.fromkeys(
                    s.node_id for s in plan.keyed if s.kind in ("process", "window", *CO_SIDES)
                )
            )
            for node_id in stateful:
                for sid, desc in state_ids[node_id]:
                    if isinstance(desc, TimerState):
                        continue
                    name = spark_state_name(uids[node_id], desc.name or str(sid))
                    if desc.kind == "map":
                        maps[sid] = handle.getMapState(name, "k binary", "v binary")
                    else:
                        values[sid] = handle.getValueState(name, "v binary")
            self.backend = SparkKeyedState(values, maps)
            self.shared = len(plan.key_bys) > 1
            #: With several key_bys and timers: the last tagged key of each shared key.
            self.shared_key = (
                handle.getValueState(SHARED_KEY_STATE, "v binary")
                if self.shared and plan.timed is not None
                else None
            )
            self.scope = KeyScope()
            self.ctx = Context(f"spark-stream-{pipeline.name}")
            self.handle = handle
            self.timers = SparkTimers(handle)
            self.window_task = _WindowTask(self.ctx.task_id, self.fail)
            self.keys: dict[str, Any] = {"bytes": b"", "group": 0}
            self.window: tuple[Any, list[Any]] | None = None
            by_id = {n.id: n for n in pipeline.nodes}
            self.names = [by_id[step.node_id].name for step in plan.keyed]
            self.fns: list[Any] = []
            #: A co-process function's two steps share one bound copy.
            bound: dict[int, Any] = {}
            for step in plan.keyed:
                fn = by_id[step.node_id].fn
                if step.node_id in bound:
                    fn = bound[step.node_id]
                elif step.kind in ("process", *CO_SIDES):
                    fn = bound[step.node_id] = copy.copy(fn)
                    for sid, desc in state_ids[step.node_id]:
                        if isinstance(desc, TimerState):
                            continue
                        assert desc.attribute is not None
                        fn.__dict__[desc.attribute] = desc.bind(self.backend, self.scope, sid)
                    fn.open(self.ctx.task_id)
                elif step.kind == "window":
                    collected: list[Any] = []
                    op = WindowOperator(
                        self.window_task,  # type: ignore[arg-type]
                        by_id[step.node_id].name,
                        fn,
                        state_ids[step.node_id],
                        self.backend,
                        self.maxp,
                        timers=self.timers,  # type: ignore[arg-type]
                    )
                    op.downstream.append(_Collect(self.window_task, collected))
                    self.window = (op, collected)
                    fn = _window_step(op, collected, self.ctx, self.keys)
                self.fns.append(fn)
            self.ctx.timers = self.timers  # type: ignore[assignment]

        def _enter(self, key: Any, timer_values: Any, records: bool) -> tuple[bytes, Any]:
            tagged = bytes(key[0])
            if self.shared:
                # Grouped by the key's bytes: the typed key is each row's own (``tkey``), for
                # a timer the last one the key's records had.
                kb = tagged[len(SHARED_KEY_TAG) :]
                last = None if self.shared_key is None else self.shared_key.get()
                tagged = bytes(last[0]) if last is not None else tag_key(kb, kb)
            k, kb = untag_key(tagged)
            self.scope.prefix = b""
            self.scope.key = self.ctx.key = k
            self.keys["bytes"], self.keys["group"] = kb, zlib.crc32(kb) % self.maxp
            watermark = -(1 << 63)
            if timer_values is not None and self.plan.timed is not None:
                watermark = timer_values.getCurrentWatermarkInMs()
                if records:
                    # Spark fires the timers up to this watermark after the batch's records:
                    # the records see the time just before the key's first of them, as in a
                    # service task, where a watermark fires its timers at once (a window
                    # whose timer has not fired yet has not fired: the record joins it).
                    due = [t for t in self.handle.listTimers() if t <= watermark]
                    if due:
                        watermark = min(due) - 1
            self.ctx.watermark = self.timers.watermark = self.window_task.watermark = watermark
            if self.window is not None:
                self.window[0].watermark = watermark
            return tagged, k

        def _run(
            self,
            value: Any,
            outs: list[tuple[int, Any]],
            failed: list[tuple[int, Exception]],
            start: int = 0,
        ) -> None:
            """``value`` through the keyed part from step ``start``: outputs into ``outs``,
            the steps that raised into ``failed``."""
            run_chain(
                self.plan.keyed,
                self.fns,
                value,
                self.ctx,
                _adder(outs),
                start=start,
                on_error=_step_failed(failed),
            )

        def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Any:
            group = bytes(key[0])
            if group == CLOCK_KEY:  # only moved the watermark
                return
            ordered = sorted(rows, key=lambda r: (r.topic, r.partition, r.offset, r.seq))
            if group == DEAD_KEY:
                for r in ordered:
                    yield _out(Row, r, -1, 0, None, r.raw, r.reason)
                return
            if group.startswith(PASS_PREFIX):  # outputs of the part before key_by
                for r in ordered:
                    yield _out(Row, r, r.sink, 0, r.out_key, r.value, None)
                return
            tagged, _ = self._enter(key, timerValues, records=True)
            scope, ctx = self.scope, self.ctx
            try:
                for pos, r in enumerate(interleaved(ordered)):
                    if self.shared and r.tkey is not None:
                        tagged = bytes(r.tkey)
                        scope.key = ctx.key = untag_key(tagged)[0]
                    scope.now = self.timers.now = self.window_task.now = r.now
                    ctx.timestamp, ctx.topic = r.ts, r.topic
                    ctx.partition, ctx.offset = r.partition, r.offset
                    outs: list[tuple[int, Any]] = []
                    failed: list[tuple[int, Exception]] = []
                    where = f"{r.topic}[{r.partition}]@{r.offset}"
                    try:
                        value = pickle.loads(r.value)
                    except Exception as exc:  # the value made it here pickled: a class gone?
                        reason = _dead(f"{where}: cannot unpickle: {exc!r}", self.fail, where)
                        yield _out(Row, r, -1, 0, tagged, r.raw, reason, pos)
                        continue
                    self._run(value, outs, failed, self.plan.keyed_roots[r.entry or 0])
                    for step, error in failed:  # the other branches went on
                        reason = f"{where}: {self.names[step]} raised {error!r}"
                        reason = _dead(reason, self.fail, where)
                        yield _out(Row, r, -1, 0, tagged, r.raw, reason, pos)
                    for reason in self.window_task.dead:
                        yield _out(Row, r, -1, 0, tagged, r.raw, reason, pos)
                    self.window_task.dead.clear()
                    for n, (sink, v) in enumerate(outs):
                        yield _out(Row, r, sink, n, tagged, pickle.dumps(v), None, pos)
                if self.shared_key is not None:
                    self.shared_key.update((tagged,))
                self.backend.flush()
            finally:
                scope.prefix = None

        def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Any:
            ts = expiredTimerInfo.getExpiryTimeInMs()
            tagged, k = self._enter(key, timerValues, records=False)
            # The batch's time, as its records see it (``now``: Spark's batch timestamp, the
            # same when a batch runs again after a crash). Left unset, state TTL read and
            # stamped in on_timer went by the wall clock: a re-run batch's state could differ
            # from the one whose output was committed (an expiry between the two runs).
            now = timerValues.getCurrentProcessingTimeInMs()
            self.scope.now = self.timers.now = self.window_task.now = now
            index = next(i for i, s in enumerate(self.plan.keyed) if s.node_id == self.plan.timed)
            step = self.plan.keyed[index]
            ctx = self.ctx
            ctx.timestamp, ctx.topic, ctx.partition, ctx.offset = ts, "", -1, -1
            #: Steps that raised (user code): dead letters of the timer, as in a service task.
            failed: list[tuple[int, Exception]] = []
            try:
                values: list[Any] = []
                if step.kind == "window":
                    assert self.window is not None
                    op, collected = self.window
                    kb, group = self.keys["bytes"], self.keys["group"]
                    op._scope.prefix = state_key_prefix(group, kb)
                    op._scope.key = k
                    if isinstance(op._assigner, SlidingWindows):
                        op._on_sliding_timer(ts, k, kb, group)
                    else:
                        op._on_window_timer(ts, k, kb, group)
                    op._scope.prefix = None
                    op._flush()
                    values = [r.value for r in collected]
                    collected.clear()
                else:
                    ctx.time_domain = "event"
                    try:
                        values.extend(self.fns[index].on_timer(ts, ctx) or ())
                    except Exception as exc:
                        _step_failed(failed)(index, exc)
                        values.clear()  # none of a failed firing's outputs, as in a service
                    finally:
                        ctx.time_domain = None
                outs: list[tuple[int, Any]] = []
                after = (index + 1,) if step.next is None else step.next
                for value in values:
                    for sink in step.sinks:
                        outs.append((sink, value))
                    for start in after:
                        if start < len(self.plan.keyed):
                            self._run(value, outs, failed, start)
                self.backend.flush()
            finally:
                self.scope.prefix = None
            timer = _TimerRow(ts, self.keys["bytes"])
            where = f"timer {ts}"
            for i, error in failed:
                what = f"{self.names[i]}.on_timer({ts})" if i == index else self.names[i]
                reason = _dead(f"{where}: {what} raised {error!r}", self.fail, where)
                yield _out(Row, timer, -1, 0, tagged, None, reason, TIMER_POS + ts)
            for reason in self.window_task.dead:  # the window's own (its function raised)
                yield _out(Row, timer, -1, 0, tagged, None, reason, TIMER_POS + ts)
            self.window_task.dead.clear()
            for n, (sink, v) in enumerate(outs):
                yield _out(Row, timer, sink, n, tagged, pickle.dumps(v), None, TIMER_POS + ts)

        def close(self) -> None:
            closed: set[int] = set()
            for step, fn in zip(self.plan.keyed, self.fns, strict=True):
                if step.kind in ("process", *CO_SIDES) and step.node_id not in closed:
                    closed.add(step.node_id)
                    fn.close()

    return KeyedChain()


def interleaved(ordered: list[Any]) -> list[Any]:
    """A key's rows of a batch, sorted by (topic, partition, offset, seq), in the order a
    service task would process them: each partition's in offset order, the partitions (and
    topics: the two sides of a join) interleaved by record time, where a service task
    interleaves them as they arrive. Sorted by topic alone, every record of the topic whose
    name sorts first ran before the other topic's (all orders of a batch before its profile
    updates). Stable and deterministic: a batch run again runs the same way."""
    runs: list[list[Any]] = []
    last: tuple[str, int] | None = None
    for r in ordered:
        if (r.topic, r.partition) != last:
            runs.append([])
            last = (r.topic, r.partition)
        runs[-1].append(r)
    if len(runs) <= 1:
        return ordered
    return list(heapq.merge(*runs, key=lambda r: r.ts))


class _TimerRow:
    """The position of a timer's outputs: after the records of its batch, in time order."""

    def __init__(self, ts: int, key_bytes: bytes) -> None:
        self.topic = "~timer"
        self.partition = -1
        self.offset = ts
        self.seq = 0
        self.ts = ts
        self.raw_key = key_bytes


def _step_failed(failed: list[tuple[int, Exception]]) -> Callable[[int, Exception], None]:
    """``run_chain``'s ``on_error`` for the keyed part: user code raising is a dead letter of
    that step; a processing-time timer ends the query (it cannot map)."""

    def on_error(step: int, exc: Exception) -> None:
        if isinstance(exc, UnmappedTimerError):
            raise exc
        failed.append((step, exc))

    return on_error


def _adder(outs: list[tuple[int, Any]]) -> Callable[[int, Any], None]:
    return lambda sink, value: outs.append((sink, value))


def _out(
    row_type: Any,
    r: Any,
    sink: int,
    n: int,
    key: bytes | None,
    value: Any,
    reason: str | None,
    pos: int | None = None,
) -> Any:
    return row_type(
        sink=sink,
        topic=r.topic,
        partition=r.partition,
        offset=r.offset,
        seq=r.seq,
        n=n,
        ts=r.ts,
        key=key,
        value=value,
        raw_key=r.raw_key,
        reason=reason,
        pos=pos,
    )


def output_order(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """The commit's sort key of an output row (OUT_SCHEMA as a tuple): a key's outputs of the
    keyed part in the order they were computed (its key's bytes, ``pos``), the other rows in
    source order (topic, partition, offset, seq, n) as before. Deterministic: a batch run again
    commits the same way."""
    pos = row[_POS]
    if pos is None or row[_KEY] is None:
        return (0, b"", 0, row[1], row[2], row[3], row[4], row[5])
    return (1, bytes(row[_KEY])[1:], pos, row[1], row[2], row[3], row[4], row[5])
