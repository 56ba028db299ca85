"""Durable file operations on a local (or NFS-mounted) filesystem: what checkpoint storage and
the Parquet sink write is on stable storage, names included, before the commit that relies on
it. Threads: any."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

__all__ = ["fsync_path", "makedirs_durable"]


def fsync_path(path: Path | str, directory: bool = False) -> None:
    """Flush a file, or a directory's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network filesystems cannot fsync a directory; the rename is still atomic there.
        if not (directory and exc.errno in (errno.EINVAL, errno.ENOTSUP, errno.EBADF)):
            raise
    finally:
        os.close(fd)


def _fsync_parent(directory: str) -> None:
    """fsync the directory holding ``directory``'s entry; one this process may not open (a
    drop-box parent, mode 0711 or 0733) is left to the filesystem: the entry was made."""
    with contextlib.suppress(PermissionError):
        fsync_path(os.path.dirname(directory) or ".", directory=True)


def makedirs_durable(path: Path | str) -> None:
    """``mkdir -p`` that fsyncs the parent of every directory it creates (a lost entry would
    lose every file under it)."""
    missing = []
    current = str(path) or "."
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current) or "."
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:  # made meanwhile by another writer; a file there is an error
            if not os.path.isdir(directory):
                raise NotADirectoryError(
                    errno.ENOTDIR, "exists and is not a directory", directory
                ) from None
        _fsync_parent(directory)
