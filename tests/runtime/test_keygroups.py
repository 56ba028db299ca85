"""Key-group math: stable hashing, contiguous ranges that cover every group exactly once."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from snapline.pipeline.keygroups import (
    key_group,
    key_group_of_state_key,
    key_group_range,
    operator_index_for_key_group,
    state_key_prefix,
)


def test_key_group_is_stable_across_processes() -> None:
    here = [key_group(f"customer-{i}".encode(), 128) for i in range(50)]
    code = (
        "from snapline.pipeline.keygroups import key_group;"
        "print([key_group(f'customer-{i}'.encode(), 128) for i in range(50)])"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
    )
    assert str(here) == other.stdout.strip()


@given(st.integers(1, 4096), st.data())
@settings(deadline=None)  # a scheduling stall on a loaded CI machine is no failure
def test_ranges_are_contiguous_and_cover_all(max_parallelism: int, data: st.DataObject) -> None:
    parallelism = data.draw(st.integers(1, max_parallelism))
    covered = []
    for index in range(parallelism):
        groups = key_group_range(index, parallelism, max_parallelism)
        assert len(groups) >= 1
        covered.extend(groups)
        for group in (groups.start, groups.stop - 1):
            assert operator_index_for_key_group(group, parallelism, max_parallelism) == index
    assert covered == list(range(max_parallelism))


@given(st.binary(max_size=64), st.integers(1, 32768))
@settings(deadline=None)
def test_key_group_in_range_and_encoded_first(key: bytes, max_parallelism: int) -> None:
    group = key_group(key, max_parallelism)
    assert 0 <= group < max_parallelism
    assert key_group_of_state_key(state_key_prefix(group, key) + b"\x01") == group


def test_prefixes_of_different_keys_never_prefix_each_other() -> None:
    a = state_key_prefix(3, b"ab")
    b = state_key_prefix(3, b"abc")
    assert not b.startswith(a) and not a.startswith(b)
