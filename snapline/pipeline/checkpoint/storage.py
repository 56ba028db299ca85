"""Checkpoint storage: any pyarrow.fs filesystem (local directory by default, S3/GCS/HDFS by URI).

All paths are relative to the storage root. Writes are atomic where the filesystem allows:
a temporary file renamed into place on a local directory; a single upload on object stores
(S3, GCS, Azure); a temporary file moved into place anywhere else (HDFS, whose move over an
existing file deletes it first: a crash between the two leaves the new file under its
temporary name and none in place, never a truncated one). On a local directory (or an NFS
mount) a write is also durable when it returns: the file is fsynced before its rename, and
its directory after it, since the Kafka transaction that names a checkpoint commits right
after its files are written. Thread-safe:
checkpoint threads write while the task thread reads nothing from here during processing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snapline.connectors.config import redact_text
from snapline.pipeline.durable import fsync_path, makedirs_durable
from snapline.pipeline.errors import (
    CheckpointError,
    CheckpointStorageError,
    ConfigurationError,
    CorruptCheckpointError,
)

if TYPE_CHECKING:
    import pyarrow.fs as pafs


def crc32_checksum(data: bytes | memoryview) -> str:
    """The checksum format stored in metadata: ``crc32:<8 hex digits>``."""
    return f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def verify_checksum(data: bytes, expected: str, what: str) -> None:
    actual = crc32_checksum(data)
    if actual != expected:
        raise CorruptCheckpointError(
            f"{what} is corrupt: checksum {actual} does not match the recorded {expected}"
        )


#: Errors of a local directory (checkpoints, a Parquet table) that its setting causes, so
#: that a restart cannot help (exit 78 with the fix): no permission, read-only, a file in the
#: path, a bad name. Others (an NFS server's EIO or ESTALE, a full disk) may pass: the worker
#: fails and its supervisor restarts it.
SETTING_ERRNOS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.ENOTDIR,
        errno.EEXIST,
        errno.ENAMETOOLONG,
        errno.ELOOP,
        errno.EINVAL,
    }
)


#: ``pyarrow.fs`` filesystems (``type_name``) whose objects appear only once their upload
#: completed, and replace an old object at once: written in place. Any other filesystem
#: (HDFS, one through fsspec) is written under a temporary name and moved into place.
OBJECT_STORES = frozenset({"s3", "gcs", "abfs"})


class CheckpointStorage:
    """A filesystem root shared by all workers of a job.

    A local directory is used through ``os`` (pyarrow is not even imported: a worker starts
    faster, which is part of recovery time); a URI (s3://, gs://, hdfs://, file://) through
    ``pyarrow.fs``."""

    def __init__(self, uri: str, *, write_delay: float | None = None) -> None:
        self.uri = uri
        self._fs: pafs.FileSystem | None = None
        if "://" in uri:
            import pyarrow.fs as pafs

            try:
                self._fs, root = pafs.FileSystem.from_uri(uri)
            except Exception as exc:  # pyarrow raises several types here
                raise CheckpointError(
                    f"cannot open checkpoint storage {redact_text(repr(uri))}: "
                    f"{redact_text(str(exc))}. Use a local directory or a "
                    "URI pyarrow.fs understands (file://, s3://, gs://, hdfs://)."
                ) from exc
            self._local = isinstance(self._fs, pafs.LocalFileSystem)
            self._whole_objects = self._fs.type_name in OBJECT_STORES
        else:
            root = str(Path(uri).absolute())
            self._local = True
            self._whole_objects = False
        self.root = root.rstrip("/")
        # A deliberate slowdown for tests that prove materialization is asynchronous.
        if write_delay is None:
            write_delay = float(os.environ.get("SNAPLINE_TEST_STORAGE_WRITE_DELAY", "0") or 0)
        self.write_delay = write_delay
        # Fault injection for tests of failing storage: a control file that a test rewrites
        # while the worker runs (see _before_write).
        self._fault_control = os.environ.get("SNAPLINE_TEST_STORAGE_FAULTS") or None
        self._writes = 0
        if self._local:
            try:
                # (Not checked for write permission: savepoints are also read from here.)
                makedirs_durable(self.root)
            except OSError as exc:
                if exc.errno not in SETTING_ERRNOS:  # EIO, ESTALE, ENOSPC...: restart me
                    raise CheckpointStorageError(
                        f"checkpoint directory {self.root} cannot be created now ({exc})"
                    ) from exc
                raise ConfigurationError(
                    f"checkpoint directory {self.root} cannot be used ({exc}); give "
                    "--checkpoint-dir (or the pipeline's checkpoint_dir) a directory this "
                    "process may create and write"
                ) from exc

    @property
    def fs(self) -> pafs.FileSystem:
        """The pyarrow filesystem of the root (for local storage: created on first use)."""
        if self._fs is None:
            import pyarrow.fs as pafs

            self._fs = pafs.LocalFileSystem()
        return self._fs

    @property
    def is_local(self) -> bool:
        return self._local

    def full_path(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    def write_bytes(self, path: str, data: bytes | memoryview) -> None:
        """Write ``data`` to ``path`` atomically (readers see the old file, the new, or none)."""
        self.write_parts(path, [data])

    def write_parts(self, path: str, parts: Sequence[bytes | memoryview]) -> tuple[int, str]:
        """Write the concatenation of ``parts`` like ``write_bytes`` without building it in
        memory (large state files); returns its size and ``crc32_checksum``."""
        self._before_write(path)
        target = self.full_path(path)
        parent = target.rsplit("/", 1)[0]
        crc = 0
        size = 0
        if self._local:
            makedirs_durable(parent)
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            views = [memoryview(part).cast("B") for part in parts]
            for view in views:
                crc = zlib.crc32(view, crc)
                size += view.nbytes
            # One writev per file where the system allows: every system call gives the GIL
            # away, and a checkpoint thread waits for it again behind the task thread.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, [v for v in views if v.nbytes])
                os.fsync(fd)
            finally:
                os.close(fd)
            _replace_durable(tmp, target)
        else:
            self.fs.create_dir(parent, recursive=True)
            written = self._beside(target)
            try:
                with self.fs.open_output_stream(written) as out:
                    for part in parts:
                        view = memoryview(part).cast("B")
                        crc = zlib.crc32(view, crc)
                        size += view.nbytes
                        out.write(view)
                self._move_into_place(written, target)
            except BaseException:
                self._drop(written, target)
                raise
        return size, f"crc32:{crc & 0xFFFFFFFF:08x}"

    def _beside(self, target: str) -> str:
        """Where a write to ``target`` goes first: ``target`` itself on an object store (an
        object appears whole once its upload completed), a temporary name beside it on any
        other filesystem (HDFS shows a file while it is written, and truncates one it
        overwrites first: a worker killed mid-write left a truncated file in its place,
        e.g. the job's checkpoint-id floor, which every later restore then failed to read)."""
        return target if self._whole_objects else f"{target}.tmp-{uuid.uuid4().hex[:8]}"

    def _move_into_place(self, written: str, target: str) -> None:
        # Only non-local filesystems come here (a local directory is written through ``os``,
        # with fsyncs): pyarrow.fs has no fsync, so durability is the filesystem's own (HDFS
        # replicates a closed file, and logs a rename in its NameNode before it returns).
        if written != target:
            self.fs.move(written, target)

    def _drop(self, written: str, target: str) -> None:
        """A failed write's temporary file (never ``target``: it keeps the old file)."""
        if written != target:
            with contextlib.suppress(Exception):
                self.fs.delete_file(written)

    def upload_file(self, local_path: str, path: str) -> None:
        """Copy a local file into storage (atomic like write_bytes)."""
        self._before_write(path)
        target = self.full_path(path)
        if self._local:
            makedirs_durable(target.rsplit("/", 1)[0])
            tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
            shutil.copyfile(local_path, tmp)
            fsync_path(tmp)
            _replace_durable(tmp, target)
        else:
            import pyarrow.fs as pafs

            self.fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
            written = self._beside(target)
            try:
                pafs.copy_files(
                    local_path,
                    written,
                    source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=self.fs,
                )
                self._move_into_place(written, target)
            except BaseException:
                self._drop(written, target)
                raise

    def _before_write(self, path: str) -> None:
        """Test hooks: a fixed delay per write, and faults read from the control file named
        by SNAPLINE_TEST_STORAGE_FAULTS: ``full`` (every write fails with ENOSPC), ``flaky``
        (every other write fails), ``slow <seconds>``; empty or missing: no fault."""
        if self.write_delay:
            time.sleep(self.write_delay)
        if self._fault_control is None:
            return
        try:
            mode = Path(self._fault_control).read_text().split()
        except FileNotFoundError:
            return
        if not mode:
            return
        self._writes += 1
        if mode[0] == "full" or (mode[0] == "flaky" and self._writes % 2 == 0):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", self.full_path(path))
        if mode[0] == "slow" and len(mode) > 1:
            time.sleep(float(mode[1]))

    def download_file(self, path: str, local_path: str) -> None:
        if self._local:
            shutil.copyfile(self.full_path(path), local_path)
            return
        import pyarrow.fs as pafs

        pafs.copy_files(
            self.full_path(path),
            local_path,
            source_filesystem=self.fs,
            destination_filesystem=pafs.LocalFileSystem(),
        )

    def open_input(self, path: str) -> Any:
        """A binary stream of ``path`` (a context manager)."""
        if self._local:
            return open(self.full_path(path), "rb")  # noqa: SIM115 - the caller closes it
        return self.fs.open_input_stream(self.full_path(path))

    def read_bytes(self, path: str) -> bytes:
        try:
            with self.open_input(path) as fh:
                return bytes(fh.read())
        except FileNotFoundError as exc:
            raise CheckpointError(f"checkpoint file {self.full_path(path)} is missing") from exc

    def exists(self, path: str) -> bool:
        if self._local:
            return os.path.exists(self.full_path(path))
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self.full_path(path))
        return info.type != pafs.FileType.NotFound

    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) of the entries directly under ``path``; empty if it does not exist."""
        if self._local:
            try:
                return sorted(os.listdir(self.full_path(path)))
            except FileNotFoundError:
                return []
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.full_path(path), allow_not_found=True, recursive=False)
        return sorted(info.base_name for info in self.fs.get_file_info(selector))

    def delete_dir(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self._local:
                shutil.rmtree(self.full_path(path))
            else:
                self.fs.delete_dir(self.full_path(path))

    def delete_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if self._local:
                os.remove(self.full_path(path))
            else:
                self.fs.delete_file(self.full_path(path))

    def size(self, path: str) -> int:
        if self._local:
            try:
                return os.path.getsize(self.full_path(path))
            except FileNotFoundError:
                return 0
        return int(self.fs.get_file_info(self.full_path(path)).size or 0)


#: The most buffers one ``writev`` takes.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write ``views`` in order to ``fd``, with as few system calls as the OS takes."""
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while written:  # drop what was written; a short write leaves part of a view
            first = views[0]
            if written >= first.nbytes:
                written -= first.nbytes
                del views[0]
            else:
                views[0] = first[written:]
                written = 0


def _replace_durable(tmp: str, target: str) -> None:
    """``os.replace`` whose rename survives a power loss once this returns (``tmp`` is
    already fsynced by the caller)."""
    os.replace(tmp, target)
    fsync_path(os.path.dirname(target), directory=True)
