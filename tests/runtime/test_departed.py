"""The abort of a departed worker's transaction: when it is on and whom it considers (the
abort itself runs against a real broker in integration_tests/test_worker_behaviour.py)."""

from __future__ import annotations

import pytest

from snapline.pipeline.runtime import departed


def test_the_abort_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPLINE_ABORT_DEPARTED", raising=False)
    assert departed.enabled()
    monkeypatch.setenv("SNAPLINE_ABORT_DEPARTED", "0")
    assert not departed.enabled()
    monkeypatch.setenv("SNAPLINE_ABORT_DEPARTED", "1")
    assert departed.enabled()


def test_checkpoints_seeded_from_a_savepoint_and_own_ones_name_nobody_to_fence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # fence_departed swallows a failed membership lookup, so a lookup is recorded, not raised.
    lookups: list[str] = []

    def group_instances(_config: object, group: str) -> set[str]:
        lookups.append(group)
        return {departed.instance_id("job", "w2")}  # w2 is a member: nobody to fence

    monkeypatch.setattr(departed, "group_instances", group_instances)
    events: list[dict[str, object]] = []
    config = {"bootstrap.servers": "127.0.0.1:1"}
    owners = {departed.SEEDED, "w1"}
    assert departed.start(config, "job", "w1", owners, events.append) is None
    assert departed.fence_departed(config, "job", "w1", owners, events.append) == []
    assert lookups == [] and events == []
    # The same call with another worker as a previous owner does look the group up.
    assert departed.fence_departed(config, "job", "w1", owners | {"w2"}, events.append) == []
    assert lookups == ["job"]
