"""Local checkpoint storage writes files of many parts whole, with their checksum."""

from __future__ import annotations

import zlib
from pathlib import Path

from snapline.pipeline.checkpoint import storage as storage_module
from snapline.pipeline.checkpoint.storage import CheckpointStorage


def test_many_parts_and_empty_parts_are_written_in_order(tmp_path: Path) -> None:
    parts = [bytes([i % 251]) * (i % 7) for i in range(3000)]  # more than IOV_MAX, some empty
    storage = CheckpointStorage(str(tmp_path))
    size, checksum = storage.write_parts("a/b.bin", [memoryview(p) for p in parts])
    data = b"".join(parts)
    assert (tmp_path / "a" / "b.bin").read_bytes() == data
    assert size == len(data)
    assert checksum == f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["b.bin"]  # no temporary left


def test_short_writes_continue_where_they_stopped(tmp_path: Path, monkeypatch) -> None:
    real = storage_module.os.writev

    def short(fd: int, buffers: list[memoryview]) -> int:  # at most 3 bytes per call
        first = next(b for b in buffers if b.nbytes)
        return real(fd, [first[:3]])

    monkeypatch.setattr(storage_module.os, "writev", short)
    parts = [b"hello ", b"", b"checkpoint ", b"world"]
    CheckpointStorage(str(tmp_path)).write_parts("x.bin", parts)
    assert (tmp_path / "x.bin").read_bytes() == b"".join(parts)
