"""The newest incarnation's mark: a worker replaced by a later process with its id stops when
fenced; the newest one, or one whose mark cannot be read, goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.runtime import incarnation
from snapline.pipeline.runtime.incarnation import SupersededError


def test_the_newest_incarnation_goes_on_and_the_one_it_replaced_stops(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    old = incarnation.register(storage, "job", "w0")
    incarnation.check_current(storage, "job", "w0", old, "producer")  # still the newest
    new = incarnation.register(storage, "job", "w0")
    incarnation.check_current(storage, "job", "w0", new, "producer")
    with pytest.raises(SupersededError) as caught:
        incarnation.check_current(storage, "job", "w0", old, "consumer")
    message = str(caught.value)
    assert "consumer was fenced" in message and "was replaced" in message
    assert f"pid {new.pid} on host {new.host}" in message and "--worker-id" in message
    assert isinstance(caught.value, ConfigurationError)  # exit 78: a restart cannot help


def test_each_worker_id_has_its_own_mark(tmp_path: Path) -> None:
    storage = CheckpointStorage(str(tmp_path))
    w0 = incarnation.register(storage, "job", "w0")
    incarnation.register(storage, "job", "w1")
    incarnation.register(storage, "other-job", "w0")
    incarnation.check_current(storage, "job", "w0", w0, "producer")


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_mark_that_cannot_be_read_stops_nobody(tmp_path: Path, damage: str) -> None:
    """Only a readable mark of another process proves a successor: a worker never stops on
    a storage problem (it is logged)."""
    storage = CheckpointStorage(str(tmp_path))
    me = incarnation.register(storage, "job", "w0")
    path = tmp_path / incarnation.mark_path("job", "w0")
    if damage == "missing":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[data.index(b'"token":"') + 9] ^= 0x01  # another token, the checksum unchanged
        path.write_bytes(bytes(data))
    incarnation.check_current(storage, "job", "w0", me, "producer")
