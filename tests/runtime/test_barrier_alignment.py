"""Barrier alignment at a task's inputs (pure logic)."""

from __future__ import annotations

import pytest

from snapline.pipeline.runtime.barrier import Barrier, BarrierAligner


def test_single_channel_releases_at_once() -> None:
    aligner = BarrierAligner(["a"])
    assert aligner.on_barrier("a", Barrier(1)) == Barrier(1)
    assert not aligner.is_blocked("a")


def test_exactly_once_blocks_channel_until_all_delivered() -> None:
    aligner = BarrierAligner(["a", "b", "c"])
    assert aligner.on_barrier("b", Barrier(5)) is None
    assert aligner.is_blocked("b") and not aligner.is_blocked("a")
    assert aligner.on_barrier("a", Barrier(5)) is None
    assert aligner.is_blocked("a") and aligner.is_blocked("b") and not aligner.is_blocked("c")
    assert aligner.on_barrier("c", Barrier(5)) == Barrier(5)
    assert not any(aligner.is_blocked(ch) for ch in "abc")
    assert aligner.blocked_count == 2


def test_at_least_once_never_blocks_but_releases_on_last() -> None:
    aligner = BarrierAligner(["a", "b"], exactly_once=False)
    assert aligner.on_barrier("a", Barrier(1)) is None
    assert not aligner.is_blocked("a")
    assert aligner.on_barrier("b", Barrier(1)) == Barrier(1)


def test_consecutive_checkpoints_align_independently() -> None:
    aligner = BarrierAligner(["a", "b"])
    aligner.on_barrier("a", Barrier(1))
    assert aligner.on_barrier("b", Barrier(1)) == Barrier(1)
    aligner.on_barrier("b", Barrier(2))
    assert aligner.pending_checkpoint == 2
    assert aligner.on_barrier("a", Barrier(2)) == Barrier(2)


def test_mixed_barriers_and_duplicates_are_errors() -> None:
    aligner = BarrierAligner(["a", "b"])
    aligner.on_barrier("a", Barrier(1))
    with pytest.raises(ValueError, match="while aligning 1"):
        aligner.on_barrier("b", Barrier(2))
    with pytest.raises(ValueError, match="twice"):
        aligner.on_barrier("a", Barrier(1))
    with pytest.raises(ValueError, match="unknown channel"):
        aligner.on_barrier("z", Barrier(1))


def test_task_drains_union_inputs_with_alignment() -> None:
    """A task with two input channels: records behind the barrier on the fast channel wait
    until the slow channel delivers its barrier, then the snapshot sees exactly the records
    before the barrier positions."""
    from snapline.pipeline.runtime.task import Channel  # noqa: F401 - the task's channel type

    aligner = BarrierAligner(["a", "b"])
    channels = {"a": ["a1", "a2", Barrier(1), "a3"], "b": ["b1", Barrier(1), "b2"]}
    processed: list[str] = []
    snapshot_at: list[list[str]] = []
    while any(channels.values()):
        progressed = False
        for name, items in channels.items():
            if not items or aligner.is_blocked(name):
                continue
            item = items.pop(0)
            progressed = True
            if isinstance(item, Barrier):
                if aligner.on_barrier(name, item) is not None:
                    snapshot_at.append(list(processed))
            else:
                processed.append(item)
        assert progressed
    assert snapshot_at == [["a1", "b1", "a2"]]
    assert set(processed) == {"a1", "a2", "a3", "b1", "b2"}
    assert processed.index("b2") > processed.index("a2")
