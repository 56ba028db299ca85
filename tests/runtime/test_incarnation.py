"""The newest incarnation's mark: a worker replaced by a later process with its id stops when
fenced, and a restart on the replaced host does not take the id back from a live holder; the
newest one, a new host, the usual restart, or a mark that cannot be read go on."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.runtime import incarnation
from snapline.pipeline.runtime.incarnation import Incarnation, SupersededError


def _never_asked() -> bool | None:
    raise AssertionError("the group was asked although nothing suggests another holder")


def _answers(*answers: bool | None) -> Callable[[], bool | None]:
    """The holder's membership, one answer per question (the last one repeated)."""
    queue: Iterator[bool | None] = iter(answers)
    last: list[bool | None] = [answers[-1]]

    def ask() -> bool | None:
        last[0] = next(queue, last[0])
        return last[0]

    return ask


def _register(
    storage: CheckpointStorage,
    host: Path,
    ask: Callable[[], bool | None] = _never_asked,
    wait: float = 0.0,
    worker_id: str = "w0",
) -> Incarnation:
    """Register worker ``worker_id`` of "job" from the host whose local directory is
    ``host``."""
    return incarnation.register(storage, "job", worker_id, host / "job.incarnation", ask, wait)


def test_the_newest_incarnation_goes_on_and_the_one_it_replaced_stops(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "chk"))
    old = _register(storage, tmp_path / "host1")
    incarnation.check_current(storage, "job", "w0", old, "producer was fenced")
    new = _register(storage, tmp_path / "host2")  # a new host: no local token, no question
    incarnation.check_current(storage, "job", "w0", new, "producer was fenced")
    with pytest.raises(SupersededError) as caught:
        incarnation.check_current(storage, "job", "w0", old, "consumer was fenced")
    message = str(caught.value)
    assert "consumer was fenced" in message and "was replaced" in message
    assert f"pid {new.pid} on host {new.host}" in message and "--worker-id" in message
    assert isinstance(caught.value, ConfigurationError)  # exit 78: a restart cannot help


def test_the_usual_restart_registers_at_once(tmp_path: Path) -> None:
    """The local token is the mark's: this host's own predecessor, dead or about to be
    fenced; the group is not even asked."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    first = _register(storage, tmp_path / "host1")
    second = _register(storage, tmp_path / "host1")
    assert second.token != first.token
    incarnation.check_current(storage, "job", "w0", second, "producer was fenced")


def test_a_restart_on_a_replaced_host_stops_while_the_holder_is_a_member(tmp_path: Path) -> None:
    """A zombie ended by its watchdog on waking and restarted on its host: another host took
    the id meanwhile and its process is a member of the group. The restart must not take the
    id back (its init_transactions would fence the live holder)."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    _register(storage, tmp_path / "host1")
    holder = _register(storage, tmp_path / "host2")
    with pytest.raises(SupersededError) as caught:
        _register(storage, tmp_path / "host1", _answers(True), wait=0.0)
    assert f"pid {holder.pid} on host {holder.host}" in str(caught.value)
    assert "took it over" in str(caught.value)
    incarnation.check_current(storage, "job", "w0", holder, "producer was fenced")  # unmoved


@pytest.mark.parametrize(
    "answers",
    [(False,), (None,), (True, False)],
    ids=["holder-gone", "kafka-cannot-say", "holder-leaves-during-the-wait"],
)
def test_a_restart_on_a_replaced_host_takes_the_id_back_once_the_holder_is_gone(
    tmp_path: Path, answers: tuple[bool | None, ...]
) -> None:
    storage = CheckpointStorage(str(tmp_path / "chk"))
    _register(storage, tmp_path / "host1")
    holder = _register(storage, tmp_path / "host2")
    back = _register(storage, tmp_path / "host1", _answers(*answers), wait=5.0)
    incarnation.check_current(storage, "job", "w0", back, "producer was fenced")
    with pytest.raises(SupersededError):
        incarnation.check_current(storage, "job", "w0", holder, "producer was fenced")


def test_each_worker_id_has_its_own_mark(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "chk"))
    w0 = _register(storage, tmp_path / "host1")
    _register(storage, tmp_path / "host1", worker_id="w1")
    incarnation.register(
        storage, "other-job", "w0", tmp_path / "host1" / "other-job.incarnation", _never_asked, 0
    )
    incarnation.check_current(storage, "job", "w0", w0, "producer was fenced")


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_mark_that_cannot_be_read_stops_nobody(tmp_path: Path, damage: str) -> None:
    """Only a readable mark of another process proves a successor: a worker never stops on
    a storage problem (it is logged), and a restart registers."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    me = _register(storage, tmp_path / "host1")
    path = tmp_path / "chk" / incarnation.mark_path("job", "w0")
    if damage == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[data.index(b'"token":"') + 9] ^= 0x01  # another token, the checksum unchanged
        path.write_bytes(bytes(data))
    incarnation.check_current(storage, "job", "w0", me, "producer was fenced")
    _register(storage, tmp_path / "host2")


def test_a_stop_during_the_wait_for_the_holder_writes_nothing(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "chk"))
    _register(storage, tmp_path / "host1")
    holder = _register(storage, tmp_path / "host2")
    stops = iter([False, False, True])
    with pytest.raises(incarnation.StopRequested):
        incarnation.register(
            storage,
            "job",
            "w0",
            tmp_path / "host1" / "job.incarnation",
            _answers(True),
            60.0,
            stopping=lambda: next(stops),
        )
    incarnation.check_current(storage, "job", "w0", holder, "producer was fenced")  # unmoved


@pytest.mark.parametrize(
    "answers",
    [(True,), (False, False, True), (None, True), (None,)],
    ids=["joined", "joins-during-the-wait", "kafka-says-later", "kafka-cannot-say"],
)
def test_a_fenced_worker_stops_once_the_later_holder_proves_to_run(
    tmp_path: Path, answers: tuple[bool | None, ...]
) -> None:
    """The successor holds the membership (it joined the group), or Kafka cannot say at all
    and the mark decides: the replaced process stops."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    old = _register(storage, tmp_path / "host1")
    new = _register(storage, tmp_path / "host2")
    with pytest.raises(SupersededError):
        incarnation.check_current(
            storage, "job", "w0", old, "producer was fenced", _answers(*answers), wait=2.5
        )
    incarnation.check_current(storage, "job", "w0", new, "producer was fenced")  # unmoved


@pytest.mark.parametrize(
    "answers", [(False,), (None, False)], ids=["never-joined", "kafka-says-later"]
)
def test_a_later_mark_whose_process_never_joins_is_a_dead_ones(
    tmp_path: Path, answers: tuple[bool | None, ...]
) -> None:
    """A process of the id registered and died before it joined the group (killed at start):
    the live worker must not stop for it, with nobody left to run the id. It writes its own
    mark back, so the next check needs no wait, and the dead one's restart on its host does
    not take the id while the live one is a member."""
    storage = CheckpointStorage(str(tmp_path / "chk"))
    live = _register(storage, tmp_path / "host1")
    dead = _register(storage, tmp_path / "host2")
    asked = _answers(*answers)
    incarnation.check_current(storage, "job", "w0", live, "producer was fenced", asked, wait=1.5)
    assert incarnation.read(storage, "job", "w0") == live
    incarnation.check_current(storage, "job", "w0", live, "producer was fenced", _never_asked)
    with pytest.raises(SupersededError):
        incarnation.check_current(storage, "job", "w0", dead, "producer was fenced")
    with pytest.raises(SupersededError):
        _register(storage, tmp_path / "host2", _answers(True), wait=0.0)


def test_a_stop_during_the_wait_for_a_later_holder_to_join(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path / "chk"))
    old = _register(storage, tmp_path / "host1")
    new = _register(storage, tmp_path / "host2")
    stops = iter([False, False, True])
    with pytest.raises(incarnation.StopRequested):
        incarnation.check_current(
            storage,
            "job",
            "w0",
            old,
            "producer was fenced",
            _answers(False),
            wait=60.0,
            stopping=lambda: next(stops),
        )
    assert incarnation.read(storage, "job", "w0") == new  # nothing written
