"""Local checkpoint storage writes files of many parts whole, with their checksum."""

from __future__ import annotations

import errno
import io
import os
import stat
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


def _record_syncs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record ``("fsync", path)`` and ``("replace", target)`` in the order they happen."""
    events: list[tuple[str, str]] = []
    paths: dict[int, str] = {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        paths[fd] = os.fspath(path)
        return fd

    def fsync(fd: Any) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        events.append(("fsync", paths.get(fd, f"fd {fd}")))
        real_fsync(fd)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        real_replace(src, dst, **kwargs)
        events.append(("replace", os.fspath(dst)))

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def test_an_uploaded_file_and_its_rename_are_durable_before_upload_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's files must survive a power loss once the Kafka transaction naming it
    commits: the copy was never fsynced, nor its directory after the rename (the checkpoint
    the committed offsets name could lose an SST, or hold a truncated one)."""
    storage = CheckpointStorage(str(tmp_path / "root"))
    local = tmp_path / "000042.sst"
    local.write_bytes(b"sst " * 1000)
    events = _record_syncs(monkeypatch)
    storage.upload_file(str(local), "job/p0/shared/000042.sst")
    target = str(tmp_path / "root" / "job" / "p0" / "shared" / "000042.sst")
    replaced = events.index(("replace", target))
    synced_before = [p for e, p in events[:replaced] if e == "fsync"]
    assert any(p.startswith(f"{target}.tmp-") for p in synced_before)  # the copy itself
    assert ("fsync", os.path.dirname(target)) in events[replaced:]  # the rename
    # The directories made for it: each entry fsynced in its parent.
    for made in ("job", "job/p0", "job/p0/shared"):
        assert ("fsync", os.path.dirname(str(tmp_path / "root" / made))) in events[:replaced]
    assert local.read_bytes() == (tmp_path / "root/job/p0/shared/000042.sst").read_bytes()


@pytest.mark.parametrize("write", ["write_bytes", "write_parts"])
def test_a_written_file_s_rename_is_durable_before_the_write_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """_metadata.json, _committed and memory state files: fsynced, and their directory
    fsynced after the rename (it was not: a power loss could lose the rename)."""
    storage = CheckpointStorage(str(tmp_path))
    storage.write_bytes("job/p0/chk-1/_metadata.json", b"old")
    events = _record_syncs(monkeypatch)
    data: Any = b"new" if write == "write_bytes" else [b"n", b"ew"]
    getattr(storage, write)("job/p0/chk-1/_metadata.json", data)
    target = str(tmp_path / "job" / "p0" / "chk-1" / "_metadata.json")
    replaced = events.index(("replace", target))
    assert any(e == "fsync" and p.startswith(f"{target}.tmp-") for e, p in events[:replaced])
    assert ("fsync", os.path.dirname(target)) in events[replaced:]
    assert storage.read_bytes("job/p0/chk-1/_metadata.json") == b"new"


def test_a_directory_fsync_the_filesystem_refuses_is_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some network filesystems cannot fsync a directory (EINVAL); their rename is still
    atomic, so the write succeeds. A file's failed fsync still fails the write."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    storage = CheckpointStorage(str(tmp_path / "root"))
    storage.write_bytes("job/a.json", b"a")
    local = tmp_path / "b.sst"
    local.write_bytes(b"b")
    storage.upload_file(str(local), "job/b.sst")
    assert storage.list_dir("job") == ["a.json", "b.sst"]

    def failing(fd: int) -> None:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):  # the file's fsync, before its rename
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        storage.upload_file(str(local), "job/c.sst")
    assert not storage.exists("job/c.sst"), "a file whose fsync failed was put in place"
