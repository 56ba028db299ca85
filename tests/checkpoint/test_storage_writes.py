"""Local checkpoint storage writes files of many parts whole, with their checksum."""

from __future__ import annotations

import io
import zlib
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

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


class _InPlaceFiles(pafs.FileSystemHandler):
    """A filesystem that shows a file while it is written and truncates one it overwrites
    (as HDFS does), over a local directory; with ``fail_after`` set, a write fails after that
    many bytes (the worker killed mid-write)."""

    def __init__(self) -> None:
        self.local = pafs.LocalFileSystem()
        self.fail_after: int | None = None

    def get_type_name(self) -> str:
        return "in-place"

    def normalize_path(self, path: str) -> str:
        return path

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.local.get_file_info(paths)  # type: ignore[no-any-return]

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.local.get_file_info(selector)  # type: ignore[no-any-return]

    def create_dir(self, path: str, recursive: bool) -> None:
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.local.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise NotImplementedError

    def delete_file(self, path: str) -> None:
        self.local.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.local.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.local.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.local.open_input_file(path)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        raise NotImplementedError

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        handler = self

        class Failing(io.RawIOBase):
            def __init__(self) -> None:
                self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
                self.written = 0

            def writable(self) -> bool:
                return True

            def write(self, data: Any) -> int:
                data = bytes(data)
                if handler.fail_after is not None:
                    data = data[: max(0, handler.fail_after - self.written)]
                    self.file.write(data)
                    self.file.flush()
                    raise OSError("killed mid-write")
                self.written += self.file.write(data)
                return len(data)

            def close(self) -> None:
                self.file.close()
                super().close()

        return pa.PythonFile(Failing(), mode="w")


def _in_place_storage(root: Path) -> tuple[CheckpointStorage, _InPlaceFiles]:
    storage = CheckpointStorage(str(root))
    handler = _InPlaceFiles()
    storage._fs = pafs.PyFileSystem(handler)
    storage._local = False
    storage._whole_objects = False
    return storage, handler


def test_a_write_killed_midway_on_a_filesystem_without_atomic_writes_keeps_the_old_file(
    tmp_path: Path,
) -> None:
    """On HDFS a file shows while it is written, and an overwrite truncates it first: a
    worker killed while it overwrote the job's checkpoint-id floor left a truncated file,
    which every later restore failed to read (the job stuck until fixed by hand). Such a
    filesystem is now written beside the file and moved into place."""
    storage, handler = _in_place_storage(tmp_path)
    old, new = b"old " * 100, b"new " * 100
    storage.write_bytes("job/checkpoint-id-floor.json", old)
    handler.fail_after = 10
    with pytest.raises(OSError, match="killed mid-write"):
        storage.write_bytes("job/checkpoint-id-floor.json", new)
    with pytest.raises(OSError, match="killed mid-write"):
        storage.write_parts("job/checkpoint-id-floor.json", [new[:7], new[7:]])
    local = tmp_path / "state.bin"
    local.write_bytes(new)
    with pytest.raises(OSError, match="killed mid-write"):
        storage.upload_file(str(local), "job/checkpoint-id-floor.json")
    assert storage.read_bytes("job/checkpoint-id-floor.json") == old
    assert storage.list_dir("job") == ["checkpoint-id-floor.json"]  # no temporary left
    handler.fail_after = None
    storage.write_bytes("job/checkpoint-id-floor.json", new)
    assert storage.read_bytes("job/checkpoint-id-floor.json") == new
    storage.upload_file(str(local), "job/state.bin")
    assert storage.read_bytes("job/state.bin") == new
    assert storage.list_dir("job") == ["checkpoint-id-floor.json", "state.bin"]
