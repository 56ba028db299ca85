"""benchmarks.hot_path runs the real operators: every input gives its output once."""

from __future__ import annotations

import pytest

from benchmarks import hot_path


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_every_system_outputs_once_per_input(backend: str) -> None:
    messages = hot_path.orders(3000, 100)
    assert hot_path.baseline(messages) == 3000
    assert hot_path.keyed(messages, backend) == 3000
    assert hot_path.two_stage(messages, backend) == 3000
