"""What a worker checks of a restored task: its positions against their partitions' logs
(Worker._checked_position): within it, kept; past its end (a truncated log, a recreated topic)
and below its start in a repartition topic, refused; below its start in a source topic,
refused unless --skip-deleted-records, which goes on from the start with an event. And a keyed
task's checkpoint against its stage's task count now (Worker._check_task_count). Topics
deleted and created again: at restore (Worker._recreated_topics) and before a checkpoint
commits (Worker._check_read_topics); and where a partition added to a "latest" source starts
(Worker._added_partition_start); and a consumer that sees no broker a fresh client reaches
(Worker._await_broker). Pure logic:
the worker's methods on a stand-in with the fields they read."""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaError, KafkaException

from snapline.pipeline.checkpoint.metadata import encode_checked
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, ConfigurationError
from snapline.pipeline.runtime import worker as worker_module
from snapline.pipeline.runtime.consumer_watch import ConsumerStuckError
from snapline.pipeline.runtime.kafka_calls import BrokerOutageError
from snapline.pipeline.runtime.worker import Worker

REPARTITION = "job.by-k.repartition"


def _worker(skip: bool) -> Any:
    events: list[dict[str, Any]] = []
    return SimpleNamespace(
        settings=SimpleNamespace(skip_deleted_records=skip),
        _repartitioned={REPARTITION},
        _event=events.append,
        events=events,
    )


def test_a_position_within_the_log_is_kept() -> None:
    worker = _worker(skip=False)
    for offset in (10, 50, 100):
        assert Worker._checked_position(worker, ("orders", 0), offset, 10, 100) == offset
    assert worker.events == []


def test_a_position_past_the_logs_end_is_refused_in_every_topic() -> None:
    for topic in ("orders", REPARTITION):
        with pytest.raises(
            ConfigurationError, match=r"continues at offset 120, but the partition ends at 100"
        ):
            Worker._checked_position(_worker(skip=True), (topic, 0), 120, 0, 100)


def test_deleted_repartition_records_are_refused_even_when_skipping_is_allowed() -> None:
    with pytest.raises(
        ConfigurationError, match=r"repartition topic .* 40 records committed by the stage before"
    ):
        Worker._checked_position(_worker(skip=True), (REPARTITION, 2), 10, 50, 100)


def test_deleted_source_records_are_refused_or_skipped_as_the_user_chose() -> None:
    with pytest.raises(ConfigurationError, match=r"continues at 10: 40 records were deleted"):
        Worker._checked_position(_worker(skip=False), ("orders", 1), 10, 50, 100)
    worker = _worker(skip=True)
    assert Worker._checked_position(worker, ("orders", 1), 10, 50, 100) == 50
    assert worker.events == [
        {
            "event": "source_records_deleted",
            "topic": "orders",
            "partition": 1,
            "from": 10,
            "to": 50,
            "records": 40,
        }
    ]


def test_a_keyed_checkpoint_of_another_task_count_is_refused() -> None:
    """Found by review: partitions added by hand to a repartition topic that declares no
    partitions=: key-groups map to tasks by the count, so keys' state stayed in one task while
    their records went to another (half the keys stalled at their old counts)."""
    from snapline.pipeline.checkpoint.metadata import CheckpointRef, TaskCheckpoint

    plan = SimpleNamespace(
        stages=[SimpleNamespace(reads=()), SimpleNamespace(reads=(REPARTITION,))]
    )
    worker = SimpleNamespace(plan=plan, _topic_partitions={REPARTITION: 2, "orders": 4})

    def meta(count: int | None) -> TaskCheckpoint:
        return TaskCheckpoint(
            "job", "s1-p0", CheckpointRef(3, "a"), "w", {}, None, task_count=count
        )

    Worker._check_task_count(worker, "s1-p0", meta(2), 1)
    Worker._check_task_count(worker, "s1-p0", meta(None), 1)  # a version before it was kept
    Worker._check_task_count(worker, "p0", meta(None), 0)
    with pytest.raises(ConfigurationError, match=r"taken with 1 tasks in its stage, but .* has 2"):
        Worker._check_task_count(worker, "s1-p0", meta(1), 1)


def test_an_out_of_range_fetch_below_the_tasks_position_is_stale_not_a_loss() -> None:
    """Seen in the long chaos test: a zombie's fetch at its old position, answered in the poll
    whose rebalance restored the task further on (the new owner had deleted those repartition
    records meanwhile), was taken for deleted records: the worker refused (exit 78). It is
    fetched again from the task's position; a failed fetch at the position is checked."""
    channel = SimpleNamespace(next_offset=6485)
    task = SimpleNamespace(channels={(REPARTITION, 3): channel})
    marks = {(REPARTITION, 3): (6369, 7000)}
    worker = _worker(skip=False)
    worker.tasks = {"s1-p3": task}
    worker._stage_of_topic = {REPARTITION: 1}
    worker.consumer = SimpleNamespace(
        get_watermark_offsets=lambda tp, timeout: marks[(tp.topic, tp.partition)]
    )
    worker._checked_position = lambda *args: Worker._checked_position(worker, *args)

    def error_at(offset: int) -> Any:
        return SimpleNamespace(
            topic=lambda: REPARTITION, partition=lambda: 3, offset=lambda: offset
        )

    assert Worker._out_of_range(worker, error_at(5424)) == 6485
    marks[(REPARTITION, 3)] = (6600, 7000)  # now records the task needs are gone
    with pytest.raises(ConfigurationError, match="starts at offset 6600"):
        Worker._out_of_range(worker, error_at(6485))
    gone = SimpleNamespace(topic=lambda: "other", partition=lambda: 0, offset=lambda: 1)
    worker._stage_of_topic["other"] = 0
    assert Worker._out_of_range(worker, gone) is None  # not this worker's partition


# --- topics deleted and created again (Worker._recreated_topics) ---------------------------


def _checkpoint(ids: dict[str, str]) -> Any:
    return SimpleNamespace(topic_ids=ids, checkpoint_id=7)


def _reader(now: dict[str, str], read_recreated: bool = False) -> Any:
    events: list[dict[str, Any]] = []
    worker = SimpleNamespace(
        settings=SimpleNamespace(read_recreated_topics=read_recreated),
        _repartitioned={REPARTITION},
        _read_topic_ids=now,
        _event=events.append,
        events=events,
    )
    worker._changed_ids = partial(Worker._changed_ids, worker)
    return worker


def test_a_topic_with_its_old_id_or_without_ids_is_not_recreated() -> None:
    same = _reader({"orders": "id-1", "refunds": ""})
    # the same id; no id now (a describe that failed, a broker without ids); none recorded
    meta = _checkpoint({"orders": "id-1", "refunds": "id-9", "gone": "id-3"})
    assert Worker._recreated_topics(same, "p0", meta) == set()
    no_ids = _reader({"orders": "AAAAAAAAAAAAAAAAAAAAAA"})
    assert Worker._recreated_topics(no_ids, "p0", _checkpoint({"orders": "id-1"})) == set()
    zero = _reader({"orders": "id-1"})  # ids given for the first time (an upgraded cluster)
    assert (
        Worker._recreated_topics(zero, "p0", _checkpoint({"orders": "AAAAAAAAAAAAAAAAAAAAAA"}))
        == set()
    )


def test_a_recreated_source_topic_is_refused_unless_the_user_chose_to_read_it_again() -> None:
    meta = _checkpoint({"orders": "id-1", "refunds": "id-2"})
    with pytest.raises(
        ConfigurationError, match=r"source topics orders \(id id-1, now id-5\) were deleted"
    ) as refused:
        Worker._recreated_topics(_reader({"orders": "id-5", "refunds": "id-2"}), "p0", meta)
    assert "--read-recreated-topics" in str(refused.value)
    worker = _reader({"orders": "id-5", "refunds": "id-2"}, read_recreated=True)
    assert Worker._recreated_topics(worker, "p0", meta) == {"orders"}
    assert [(e["event"], e["topic"], e["old_id"], e["new_id"]) for e in worker.events] == [
        ("source_topic_recreated", "orders", "id-1", "id-5")
    ]


def test_a_recreated_repartition_topic_is_refused_whatever_the_user_chose() -> None:
    worker = _reader({REPARTITION: "id-8"}, read_recreated=True)
    with pytest.raises(ConfigurationError, match=r"repartition topics .* were created again"):
        Worker._recreated_topics(worker, "s1-p0", _checkpoint({REPARTITION: "id-4"}))


# --- the id check before a checkpoint commits (Worker._check_read_topics) -------------------


def _answer(topic_id: str | None = None, unknown: bool = False) -> Future[Any]:
    future: Future[Any] = Future()
    if unknown:
        future.set_exception(KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)))
    else:
        future.set_result(SimpleNamespace(topic_id=topic_id))
    return future


def _committer(
    asked: dict[str, Future[Any]], again: dict[str, Future[Any]] | None = None, **over: Any
) -> Any:
    events: list[dict[str, Any]] = []
    admin = SimpleNamespace(describe_topics=lambda topics, request_timeout: again or {})
    fields = {
        "_id_check": asked,
        "_read_topics": {"orders"},
        "_read_topic_ids": {"orders": "id-1"},
        "_broker_reachable": lambda: True,
        "liveness": SimpleNamespace(beat=lambda: None),
        "_background_admin": lambda: admin,
        "_event": events.append,
        "events": events,
    }
    worker = SimpleNamespace(**{**fields, **over})
    worker._described = partial(Worker._described, worker)
    return worker


def test_a_checkpoint_commits_when_its_topics_kept_their_ids() -> None:
    Worker._check_read_topics(_committer({"orders": _answer("id-1")}), 5)
    # a broker that did not know the topic, then did, with the same id (it was restarting)
    lagging = _committer({"orders": _answer(unknown=True)}, again={"orders": _answer("id-1")})
    Worker._check_read_topics(lagging, 5)
    assert lagging.events == []


def test_a_checkpoint_of_a_recreated_or_deleted_topic_does_not_commit() -> None:
    worker = _committer({"orders": _answer("id-2")})
    with pytest.raises(CheckpointError, match=r"orders \(id id-1, now id-2\) were deleted"):
        Worker._check_read_topics(worker, 5)
    assert [e["event"] for e in worker.events] == ["read_topic_recreated"]
    gone = _committer({"orders": _answer(unknown=True)}, again={"orders": _answer(unknown=True)})
    with pytest.raises(CheckpointError, match=r"orders \(deleted\)"):
        Worker._check_read_topics(gone, 5)


def test_ids_unknown_at_restore_are_waited_out_only_while_the_broker_is_unreachable() -> None:
    unknown = {"_read_topic_ids": {}}
    with pytest.raises(BrokerOutageError, match="did not describe topics"):
        Worker._check_read_topics(_committer({}, _broker_reachable=lambda: False, **unknown), 5)
    with pytest.raises(CheckpointError, match="did not describe topics") as counted:
        Worker._check_read_topics(_committer({}, **unknown), 5)
    assert not isinstance(counted.value, BrokerOutageError)  # counts against the job


# --- a partition added to a "latest" source (Worker._added_partition_start) -----------------


def test_only_a_partition_added_to_a_latest_source_after_the_start_is_read_from_its_start() -> None:
    events: list[dict[str, Any]] = []
    worker = SimpleNamespace(
        _latest_at_start={"orders": 4, "clicks": 2},
        _latest_ids={"orders": "id-orders", "clicks": "id-clicks-1"},
        _read_topic_ids={"orders": "id-orders", "clicks": "id-clicks-2"},
        _added_partitions=set(),
        _reset_tasks={"p5"},
        _event=events.append,
    )

    def start(tp: tuple[str, int], position: int, task: str = "p0") -> int:
        return int(Worker._added_partition_start(worker, task, tp, position))

    assert start(("orders", 3), OFFSET_END) == OFFSET_END
    assert start(("orders", 0), OFFSET_BEGINNING) == OFFSET_BEGINNING
    assert start(("other", 9), OFFSET_END) == OFFSET_END
    assert start(("orders", 5), OFFSET_END, task="p5") == OFFSET_END  # --reset-state: now
    for _ in range(2):
        assert start(("orders", 4), OFFSET_END) == OFFSET_BEGINNING
    # "clicks" was deleted and created again while the worker ran (its id at this restore is
    # not the one its counts are of): all of it came after the job started.
    assert start(("clicks", 0), OFFSET_END) == OFFSET_BEGINNING
    assert start(("clicks", 0), OFFSET_END, task="p5") == OFFSET_END  # --reset-state: now
    assert events == [
        {"event": "source_partition_added", "topic": "orders", "partition": 4},
        {"event": "source_partition_added", "topic": "clicks", "partition": 0},
    ]


def test_a_latest_topic_created_again_is_recorded_with_no_partitions_unless_state_is_reset(
    tmp_path: Path,
) -> None:
    """source-partitions.json records a "latest" topic whose id changed since with no
    partitions (all of the new topic came after the job started: its partitions with no
    committed offset are read from their beginning), except in a --reset-state run, which
    starts over now; an id missing from a file of an earlier version is filled in."""
    storage = CheckpointStorage(str(tmp_path))
    ids = {"orders": "id-1", "clicks": "id-c"}
    partitions = {"orders": 3, "clicks": 2}

    def recorded(on_missing_offsets: str = "fail") -> tuple[dict[str, int], dict[str, str]]:
        worker = SimpleNamespace(
            pipeline=SimpleNamespace(
                name="job",
                sources=lambda: [
                    SimpleNamespace(starting_position="latest", topic_list=["orders", "clicks"])
                ],
            ),
            storage=storage,
            settings=SimpleNamespace(on_missing_offsets=on_missing_offsets),
            _topic_partitions=partitions,
            _topic_ids=lambda topics, what: {t: ids[t] for t in topics},
        )
        counts = Worker._latest_partitions_at_start(worker)
        return counts, worker._latest_ids

    assert recorded() == ({"orders": 3, "clicks": 2}, ids)
    ids["orders"] = "id-2"  # deleted and created again with more partitions
    assert recorded() == ({"orders": 0, "clicks": 2}, ids)
    assert recorded() == ({"orders": 0, "clicks": 2}, ids)  # and so for the next starts
    ids["orders"] = "id-3"
    partitions["clicks"] = 4  # grew while the job was down: still added after its start
    assert recorded("reset-state") == ({"orders": 3, "clicks": 2}, {})
    # A file of an earlier version, without ids: they are filled in, the counts kept.
    earlier = {"partitions": {"orders": 1, "clicks": 1}}
    storage.write_bytes("job/source-partitions.json", encode_checked(earlier))
    assert recorded() == ({"orders": 1, "clicks": 1}, ids)
    ids["orders"] = "id-4"
    assert recorded() == ({"orders": 0, "clicks": 1}, ids)


# --- waiting for the broker (Worker._await_broker) ------------------------------------------


def _waiting(consumer_sees: Any, fresh_sees: Any) -> Any:
    events: list[dict[str, Any]] = []
    return SimpleNamespace(
        _broker_reachable=lambda fresh_client=False, timeout=2.0: (
            fresh_sees() if fresh_client else consumer_sees(timeout)
        ),
        _stopping=False,
        liveness=SimpleNamespace(beat=lambda: None),
        settings=SimpleNamespace(bootstrap_servers="b:9092"),
        _event=events.append,
        events=events,
    )


def test_a_consumer_blind_to_a_broker_a_fresh_client_reaches_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_module, "CONSUMER_BLIND_AFTER", 0.3)
    monkeypatch.setattr(worker_module, "backoff", lambda attempt, cap: 0.05)
    # Without the check it would wait until the consumer saw the broker (here: after ~2 s).
    blind = iter([False] * 40 + [True])
    stuck = _waiting(lambda timeout: next(blind), lambda: True)
    with pytest.raises(ConsumerStuckError, match="a new client reaches the broker"):
        Worker._await_broker(stuck, BrokerOutageError("commit timed out"))
    # A consumer that answers within the fresh client's longer timeout is slow, not stuck.
    slow = _waiting(lambda timeout: timeout > 2.0, lambda: True)
    Worker._await_broker(slow, BrokerOutageError("commit timed out"))
    assert [e["event"] for e in slow.events] == ["broker_unavailable", "broker_back"]
    # The broker is away for everyone: the worker waits on (and asks the fresh client again).
    asked: list[float] = []
    answers = iter([False] * 20 + [True])
    away = _waiting(lambda timeout: next(answers), lambda: asked.append(1.0) or False)
    Worker._await_broker(away, BrokerOutageError("commit timed out"))
    assert len(asked) >= 2, "a fresh client was not asked again"
    assert [e["event"] for e in away.events] == ["broker_unavailable", "broker_back"]
