"""Watermarks of a task: bounded out-of-orderness per source partition, minimum over the
channels, idle channels excluded, upstream tasks' watermark records, restore never going
back, and watermark records never read as data."""

from __future__ import annotations

from typing import Any

from snapline.pipeline.runtime.watermarks import (
    MIN_WATERMARK,
    SourceChannelClock,
    TaskClock,
    UpstreamChannelClock,
    WatermarkRecord,
    decode_floors,
    encode_floors,
    with_floors,
)

A, B = ("t", 0), ("t", 1)
S0 = frozenset({"s0"})


def test_source_channel_trails_the_largest_timestamp_by_the_bound() -> None:
    clock = SourceChannelClock(out_of_orderness=5, idle_timeout=None, now=0.0)
    assert clock.watermark() == MIN_WATERMARK
    clock.observe(100, 1.0)
    clock.observe(90, 2.0)  # out of order: the watermark does not go back
    assert clock.watermark() == 94
    assert not clock.idle(1000.0, backlog=False)  # no idle timeout


def test_task_watermark_is_the_minimum_over_channels_and_never_decreases() -> None:
    clock = TaskClock({A: SourceChannelClock(0, None, 0.0), B: SourceChannelClock(0, None, 0.0)})
    clock.observe(A, 50, 0.0)
    assert not clock.advance(0.0, {})  # B has seen nothing: the minimum is still MIN
    clock.observe(B, 30, 0.0)
    assert clock.advance(0.0, {}) and clock.watermark == 29
    clock.observe(B, 80, 0.0)
    assert clock.advance(0.0, {}) and clock.watermark == 49


def test_an_idle_partition_stops_holding_the_watermark_back() -> None:
    clock = TaskClock({A: SourceChannelClock(0, 2.0, 0.0), B: SourceChannelClock(0, 2.0, 0.0)})
    clock.observe(A, 50, 1.0)
    assert not clock.advance(1.5, {})
    assert not clock.advance(2.5, {B: True})  # B has a backlog: not idle however quiet
    assert clock.advance(2.5, {}) and clock.watermark == 49 and not clock.idle
    clock.observe(B, 10, 3.0)  # B wakes up behind the watermark: its records are late
    assert not clock.advance(3.0, {}) and clock.watermark == 49
    # Both idle: the largest channel watermark (49), and say so.
    assert clock.advance(10.0, {}) is False and clock.idle and clock.watermark == 49


def test_when_every_channel_is_idle_the_watermark_moves_to_the_largest() -> None:
    clock = TaskClock({A: SourceChannelClock(0, 1.0, 0.0), B: SourceChannelClock(0, 1.0, 0.0)})
    clock.observe(A, 50, 0.0)
    clock.observe(B, 20, 0.0)
    assert clock.advance(0.5, {}) and clock.watermark == 19
    assert clock.advance(2.0, {}) and clock.watermark == 49 and clock.idle


class Ends:
    """What Kafka says of each partition's end, as runtime/source_ends.py answers: True (read
    to its end), False (records wait, or unknown), None (asked, no answer yet)."""

    def __init__(self, **answers: bool | None) -> None:
        self.answers = {A: answers.get("a"), B: answers.get("b")}
        self.asked: list[tuple[str, int]] = []

    def __call__(self, tp: tuple[str, int], since: float) -> bool | None:
        self.asked.append(tp)
        return self.answers[tp]


def test_a_quiet_partition_with_records_waiting_in_kafka_is_not_idle() -> None:
    """A paused consumer (a savepoint being written) reads nothing, locally every channel is
    quiet; B's backlog in Kafka keeps B holding the watermark back, so the records it then
    reads are not late. Before, both went idle and the watermark jumped to A's."""
    ends = Ends(a=True, b=False)
    clock = TaskClock(
        {A: SourceChannelClock(0, 2.0, 0.0, A), B: SourceChannelClock(0, 2.0, 0.0, B)}
    )
    clock.observe(A, 500, 1.0)
    clock.observe(B, 10, 1.0)
    assert clock.advance(1.5, {}, ends) and clock.watermark == 9
    assert not clock.advance(5.0, {}, ends) and clock.watermark == 9 and not clock.idle
    assert ends.asked == [A, B]  # asked only once the timeout passed
    # B's answer restarts its timeout: not asked again before another 2 s of quiet.
    assert not clock.advance(6.0, {}, ends) and ends.asked == [A, B]
    # A stays idle, asked again once per timeout (at 7.0 or later): still at its end.
    assert not clock.advance(7.5, {}, ends) and ends.asked == [A, B, A, B]
    assert clock.channels[A].idle(7.6, False, ends) and ends.asked.count(A) == 2
    # B's backlog read to the end: B idle too, and then the largest watermark.
    ends.answers[B] = True
    clock.observe(B, 40, 8.0)
    assert clock.advance(8.5, {}, ends) and clock.watermark == 39
    assert clock.advance(10.5, {}, ends) and clock.watermark == 499 and clock.idle


def test_a_partition_is_not_idle_while_kafka_has_not_answered() -> None:
    ends = Ends(a=None, b=None)
    clock = TaskClock({A: SourceChannelClock(0, 1.0, 0.0, A)})
    clock.observe(A, 50, 0.0)
    assert clock.advance(0.5, {}, ends)
    assert not clock.advance(5.0, {}, ends) and not clock.idle
    ends.answers[A] = True
    assert not clock.advance(5.1, {}, ends) and clock.idle
    clock.observe(A, 60, 6.0)  # a record: no longer known to be at its end
    assert clock.advance(6.0, {}, ends) and not clock.idle
    ends.answers[A] = False
    assert not clock.advance(7.5, {}, ends) and not clock.idle


def test_upstream_watermark_is_the_minimum_over_every_writer() -> None:
    channel = UpstreamChannelClock(frozenset({"p0", "p1"}))
    channel.update(WatermarkRecord("p0", 100, False))
    assert channel.watermark() == MIN_WATERMARK  # p1 not heard from yet
    channel.update(WatermarkRecord("p1", 40, False))
    assert channel.watermark() == 40
    channel.update(WatermarkRecord("p1", 30, False))  # a stale record never moves it back
    channel.update(WatermarkRecord("p7", 0, False))  # not an upstream task (any more)
    assert channel.watermark() == 40
    channel.update(WatermarkRecord("p1", 40, True))  # p1 idle: p0 alone decides
    assert channel.watermark() == 100 and not channel.idle(0.0, False)
    channel.update(WatermarkRecord("p0", 100, True))
    assert channel.idle(0.0, False) and not channel.idle(0.0, True)
    assert channel.watermark() == 100  # all idle: the largest, so that windows close


def test_restore_continues_from_the_checkpointed_clock() -> None:
    clock = TaskClock({A: SourceChannelClock(3, None, 0.0), B: UpstreamChannelClock(S0)})
    clock.observe(A, 100, 0.0)
    clock.upstream(B, WatermarkRecord("s0", 70, False))
    clock.advance(0.0, {})
    saved = clock.snapshot()
    assert clock.watermark == 70
    restored = TaskClock({A: SourceChannelClock(3, None, 0.0), B: UpstreamChannelClock(S0)})
    restored.restore(saved)
    assert restored.watermark == 70
    restored.observe(A, 50, 0.0)  # replayed records cannot pull the watermark back
    restored.advance(0.0, {})
    assert restored.watermark == 70 and restored.snapshot() == saved


def test_key_group_floors_hold_until_the_watermark_passes_them_across_restores() -> None:
    """After a rescale that merged tasks (savepoint/restore.py ``_clock``): key-groups 4-7 came
    from a task that was at 300 while the task starts at 100."""
    floors = {g: 300 for g in range(4, 8)} | {9: 200}
    assert encode_floors(floors) == [[4, 7, 300], [9, 9, 200]]
    assert decode_floors(encode_floors(floors)) == floors
    clock = TaskClock({B: UpstreamChannelClock(S0)})
    clock.restore({"watermark": 100, "channels": [], "floors": encode_floors(floors)})
    assert clock.watermark == 100 and clock.floors == floors
    clock.upstream(B, WatermarkRecord("s0", 250, False))
    assert clock.advance(0.0, {})
    assert clock.floors == {g: 300 for g in range(4, 8)}  # 9's floor is passed
    again = TaskClock({B: UpstreamChannelClock(S0)})
    again.restore(clock.snapshot())  # a checkpoint of the task before it passed them
    assert again.floors == clock.floors
    again.upstream(B, WatermarkRecord("s0", 300, False))
    assert again.advance(0.0, {}) and again.floors == {} and "floors" not in again.snapshot()


def test_records_take_the_floor_of_their_key_group_in_their_order() -> None:
    class R:
        def __init__(self, key_group: int) -> None:
            self.key_group = key_group

    records = [R(1), R(5), R(6), R(1), R(9)]
    runs = with_floors(100, {5: 300, 6: 300, 9: 50}, records)
    assert [(mark, [r.key_group for r in run]) for mark, run in runs] == [
        (100, [1]),
        (300, [5, 6]),
        (100, [1, 9]),  # a floor below the watermark does not lower it
    ]


def test_watermark_records_are_told_apart_from_data_keys() -> None:
    record = WatermarkRecord("s1-p3", 1234, True)
    assert WatermarkRecord.is_watermark_key(record.key())
    assert WatermarkRecord.decode(record.key(), record.value()) == record
    for data_key in (b"sabc", b"b\x00", b'j{"a":1}', None):
        assert not WatermarkRecord.is_watermark_key(data_key)


def test_an_answer_from_an_earlier_quiet_spell_is_not_used() -> None:
    """The end was asked, a record came before the answer was read, and the answer (end 100)
    stayed stored: at the next timeout, much later, it was compared with that day's position
    (5,000, with 10,000 records waiting behind a paused consumer) and the partition was called
    idle. An answer is now used only for the quiet spell it was asked in (a review's repro)."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from snapline.pipeline.runtime.source_ends import SourceEnds

    end, position = {"at": 100}, {"at": 100}

    class Admin:
        def list_offsets(self, request: Any, **_: Any) -> Any:
            answer: Future[Any] = Future()
            answer.set_result(SimpleNamespace(offset=end["at"]))
            return dict.fromkeys(request, answer)

    ends = SourceEnds(Admin, lambda tp: position["at"])
    clock = TaskClock(
        {A: SourceChannelClock(0, 2.0, 0.0, A), B: SourceChannelClock(0, 2.0, 0.0, B)}
    )
    clock.observe(A, 1_000, 0.0)
    clock.observe(B, 60_000, 0.0)
    clock.advance(2.5, {}, ends)  # A and B asked; answers on their way
    clock.observe(A, 2_000, 2.6)  # a record before A's answer was read
    position["at"], end["at"] = 5_000, 15_000  # later: paused with 10,000 records waiting
    clock.observe(A, 50_000, 600.0)
    clock.observe(B, 60_000, 600.0)
    clock.advance(603.0, {}, ends)
    clock.advance(603.1, {}, ends)
    assert not clock.channels[A].idle(603.1, False, ends) and clock.watermark == 49_999


def test_an_idle_partition_whose_records_arrive_while_nothing_is_read_is_no_longer_idle() -> None:
    """A was read to its end and idle; the consumer was then paused (a savepoint) while
    records arrived on A and B. A was idle until a record of it was processed: on resume
    B's records moved the watermark and A's, read after them, were late. A is asked again
    every timeout while idle, and records waiting end its idleness."""
    ends = Ends(a=True, b=False)
    clock = TaskClock(
        {A: SourceChannelClock(0, 2.0, 0.0, A), B: SourceChannelClock(0, 2.0, 0.0, B)}
    )
    clock.observe(A, 1_000, 0.0)
    clock.observe(B, 1_000, 0.0)
    clock.observe(B, 5_000, 2.5)
    clock.advance(2.5, {}, ends)
    assert clock.channels[A].idle(2.5, False, ends) and clock.watermark == 4_999
    ends.answers[A] = False  # records of A (event time ~5,000 on) wait behind the pause
    clock.observe(B, 6_000, 3.0)
    clock.advance(3.0, {}, ends)
    assert clock.watermark == 5_999  # A still idle as last known, asked at most every 2 s
    clock.observe(B, 7_000, 4.6)
    clock.advance(4.6, {}, ends)  # asked again: records wait
    assert not clock.channels[A].idle(4.6, False, ends)
    clock.observe(B, 9_000, 4.7)
    clock.advance(4.7, {}, ends)
    assert clock.watermark == 5_999, "A's waiting records would be late"
