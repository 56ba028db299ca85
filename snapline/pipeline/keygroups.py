"""Key-groups: ``hash(key) mod max_parallelism``, the atomic unit of keyed state (DESIGN §2).

The hash is CRC-32 of the serialized key, so it is stable across processes and Python
versions (Python's ``hash`` is salted per process and must never decide where state lives).
"""

from __future__ import annotations

import struct
import zlib

DEFAULT_MAX_PARALLELISM = 128
MAX_MAX_PARALLELISM = 32768

_KG = struct.Struct(">H")
_LEN = struct.Struct(">I")
_KG_LEN = struct.Struct(">HI")
#: The header of a stored key's prefix: key-group (2 bytes) and key length (4), big-endian
#: (hot loops pack it themselves instead of calling ``state_key_prefix``).
KEY_PREFIX = _KG_LEN


def key_group(key_bytes: bytes, max_parallelism: int) -> int:
    """The key-group of a serialized key."""
    return zlib.crc32(key_bytes) % max_parallelism


def key_group_range(operator_index: int, parallelism: int, max_parallelism: int) -> range:
    """The contiguous key-groups owned by subtask ``operator_index`` of ``parallelism``.

    Ranges are contiguous and cover ``[0, max_parallelism)`` exactly once, so rescaling moves
    whole ranges (Flink's KeyGroupRangeAssignment).
    """
    if not 0 < parallelism <= max_parallelism:
        raise ValueError(f"parallelism {parallelism} must be in 1..{max_parallelism}")
    if not 0 <= operator_index < parallelism:
        raise ValueError(f"operator index {operator_index} must be in 0..{parallelism - 1}")
    start = (operator_index * max_parallelism + parallelism - 1) // parallelism
    end = ((operator_index + 1) * max_parallelism - 1) // parallelism + 1
    return range(start, end)


def operator_index_for_key_group(group: int, parallelism: int, max_parallelism: int) -> int:
    """Which subtask of ``parallelism`` owns key-group ``group``."""
    return group * parallelism // max_parallelism


def state_key_prefix(group: int, key_bytes: bytes) -> bytes:
    """The stored prefix of one key: ``key_group(2) | len(4) | key``; a state id byte follows."""
    return _KG_LEN.pack(group, len(key_bytes)) + key_bytes


def key_group_of_state_key(stored_key: bytes) -> int:
    return int(_KG.unpack_from(stored_key)[0])


def key_group_prefix(group: int) -> bytes:
    """The first bytes of every stored key of ``group`` (for range deletes and ingestion)."""
    return _KG.pack(group)
