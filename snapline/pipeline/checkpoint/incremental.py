"""Incremental checkpoint files: content-named shared files, per-checkpoint manifests, verified
transfers, and the retention rule that deletes shared files no retained checkpoint references.

Layout in checkpoint storage, for a task directory ``<job>/tasks/<task>``::

    shared/<stem>-<crc32>-<checkpoint id>.sst   immutable files, uploaded once, referenced by
                                                 every later checkpoint that still holds them
    chk-<id>-<attempt>/<small private files>     e.g. MANIFEST, CURRENT, OPTIONS of RocksDB
    chk-<id>-<attempt>/state-manifest.json       every file of the checkpoint: path, size, crc32

There is no mutable reference-count file: the references of a checkpoint are the files of its
``StateHandle`` (stored in the checkpoint's metadata), so the set of live shared files is derived
from the retained checkpoints alone and is correct after any crash.

Threads: everything here runs on checkpoint threads (materialize, retention) or on the task
thread during restore; ``SharedFileRegistry`` is the one object both touch and it is locked.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from snapline.connectors.config import redact_text
from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.errors import CheckpointError, CorruptCheckpointError
from snapline.pipeline.state.backend import StateFile, StateHandle

log = logging.getLogger(__name__)

SHARED_DIR = "shared"
MANIFEST_FILE = "state-manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 4 << 20
#: ``000123-89abcdef-42.sst``: the local file name's stem, the CRC-32 of the content, and the
#: checkpoint that uploaded it. The id lets retention tell finished uploads from in-flight ones.
_SHARED_NAME = re.compile(r"^(?P<stem>[^/]+?)-(?P<crc>[0-9a-f]{8})-(?P<cid>\d+)(?P<ext>\.[a-z]+)")


# ------------------------------------------------------------------ names and checksums
def shared_directory(checkpoint_directory: str) -> str:
    """``<job>/tasks/<task>/shared`` for ``<job>/tasks/<task>/chk-<n>-<attempt>``."""
    parent, _, leaf = checkpoint_directory.rstrip("/").rpartition("/")
    if not parent or not leaf:
        raise CheckpointError(
            f"checkpoint directory {checkpoint_directory!r} has no parent; the runtime passes "
            "'<job>/tasks/<task>/chk-<n>-<attempt>'"
        )
    return f"{parent}/{SHARED_DIR}"


def shared_file_name(local_name: str, checksum: str, checkpoint_id: int) -> str:
    """The content-unique name of a shared copy of ``local_name`` (e.g. ``000012.sst``)."""
    stem, dot, ext = local_name.rpartition(".")
    if not dot:
        stem, ext = local_name, "bin"
    return f"{stem}-{checksum.removeprefix('crc32:')}-{checkpoint_id}.{ext}"


def parse_shared_file_name(name: str) -> tuple[str, int] | None:
    """``(local name, uploading checkpoint id)`` of a shared file name (also of its temp files)."""
    match = _SHARED_NAME.match(name)
    if match is None:
        return None
    return match.group("stem") + match.group("ext"), int(match.group("cid"))


def local_name(path: str) -> str:
    """The name a file of a handle has in a local directory (shared files lose crc and id)."""
    parent, _, base = path.rpartition("/")
    if parent.rsplit("/", 1)[-1] == SHARED_DIR:
        parsed = parse_shared_file_name(base)
        if parsed is not None and base == shared_file_name(parsed[0], _crc_of(base), parsed[1]):
            return parsed[0]
    return base


def _crc_of(shared_name: str) -> str:
    match = _SHARED_NAME.match(shared_name)
    return "" if match is None else f"crc32:{match.group('crc')}"


def file_checksum(path: str | os.PathLike[str]) -> str:
    """CRC-32 of a local file, read in chunks (large SST files never sit in memory whole)."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


# ------------------------------------------------------------------ the per-checkpoint manifest
@dataclass(frozen=True)
class StateManifest:
    """Every file of one checkpoint of one task, with the name it has in a local directory."""

    checkpoint_id: int
    files: tuple[StateFile, ...]
    local_names: tuple[str, ...]

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "format": MANIFEST_FORMAT,
                "checkpoint_id": self.checkpoint_id,
                "files": [
                    {"path": f.path, "size": f.size, "checksum": f.checksum, "local_name": n}
                    for f, n in zip(self.files, self.local_names, strict=True)
                ],
            },
            option=orjson.OPT_INDENT_2,
        )

    @staticmethod
    def decode(data: bytes, what: str) -> StateManifest:
        try:
            body = orjson.loads(data)
            files = tuple(
                StateFile(f["path"], int(f["size"]), f["checksum"]) for f in body["files"]
            )
            names = tuple(f["local_name"] for f in body["files"])
            return StateManifest(int(body["checkpoint_id"]), files, names)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{what} is not a valid state manifest: {exc}") from exc


# ------------------------------------------------------------------ what is already uploaded
class SharedFileRegistry:
    """Which local immutable files of one backend instance are already in shared storage.

    A local file name is unique for the life of one RocksDB instance (file numbers only grow), so
    ``(name, size)`` identifies content without re-reading it. The registry holds the shared
    files of the newest checkpoint materialized to (or restored from) one shared directory; a
    file is reused only if it is still live, i.e. it was live continuously since that
    checkpoint, and so every checkpoint in between references it too — which is why retention
    can never delete a file a later checkpoint reuses (see ``discard_unreferenced_files``).
    ``location`` is the shared directory's full path: a checkpoint written elsewhere (another
    storage, a savepoint) reuses nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._location: str | None = None
        self._files: dict[str, StateFile] = {}
        self._checkpoint_id = -1

    def lookup(self, location: str, name: str, size: int) -> StateFile | None:
        with self._lock:
            found = self._files.get(name) if location == self._location else None
        return found if found is not None and found.size == size else None

    def record(self, location: str, checkpoint_id: int, files: Mapping[str, StateFile]) -> None:
        """The shared files of a materialized checkpoint; an older checkpoint never wins."""
        with self._lock:
            if location != self._location or checkpoint_id >= self._checkpoint_id:
                self._location = location
                self._files = dict(files)
                self._checkpoint_id = checkpoint_id

    def reset(self, location: str, checkpoint_id: int, files: Mapping[str, StateFile]) -> None:
        """After a restore: exactly the restored checkpoint's shared files."""
        with self._lock:
            self._location = location
            self._files = dict(files)
            self._checkpoint_id = checkpoint_id

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)


# ------------------------------------------------------------------ upload
@dataclass(frozen=True)
class UploadResult:
    """A materialized incremental checkpoint: its handle plus what it cost."""

    handle: StateHandle
    uploaded_bytes: int
    reused_bytes: int
    uploaded_files: int
    reused_files: int


def upload_incremental(
    storage: CheckpointStorage,
    local_dir: str | os.PathLike[str],
    directory: str,
    checkpoint_id: int,
    registry: SharedFileRegistry,
    *,
    backend: str,
    is_shared: Any,
    threads: int = 4,
) -> UploadResult:
    """Upload a local checkpoint directory: new shared files once, private files every time.

    ``is_shared(name)`` says which files are immutable and go to the shared area (SST files).
    Runs on a checkpoint thread; ``local_dir`` must not change while this runs.
    """
    root = Path(local_dir)
    shared_dir = shared_directory(directory)
    location = storage.full_path(shared_dir)
    names = sorted(os.listdir(root))
    shared_names = [n for n in names if is_shared(n)]
    private_names = [n for n in names if not is_shared(n)]

    def upload_shared(name: str) -> tuple[str, StateFile, bool]:
        local = root / name
        size = local.stat().st_size
        known = registry.lookup(location, name, size)
        if known is not None:
            return name, known, False
        checksum = file_checksum(local)
        path = f"{shared_dir}/{shared_file_name(name, checksum, checkpoint_id)}"
        storage.upload_file(str(local), path)
        return name, StateFile(path, size, checksum), True

    def upload_private(name: str) -> StateFile:
        data = (root / name).read_bytes()
        path = f"{directory}/{name}"
        storage.write_bytes(path, data)
        return StateFile(path, len(data), f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}")

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="state-upload") as pool:
        shared_futures = [pool.submit(upload_shared, n) for n in shared_names]
        private_futures = [pool.submit(upload_private, n) for n in private_names]
        shared = [f.result() for f in shared_futures]
        private = [f.result() for f in private_futures]

    files = tuple(private) + tuple(sf for _, sf, _ in shared)
    local_names = tuple(private_names) + tuple(n for n, _, _ in shared)
    manifest = StateManifest(checkpoint_id, files, local_names)
    manifest_path = f"{directory}/{MANIFEST_FILE}"
    storage.write_bytes(manifest_path, manifest.encode())
    registry.record(location, checkpoint_id, {n: sf for n, sf, _ in shared})
    uploaded = [sf for _, sf, new in shared if new]
    reused = [sf for _, sf, new in shared if not new]
    uploaded_bytes = sum(f.size for f in uploaded) + sum(f.size for f in private)
    handle = StateHandle(
        backend,
        files,
        {
            "checkpoint_id": checkpoint_id,
            "manifest": manifest_path,
            "incremental_bytes": uploaded_bytes,
        },
    )
    return UploadResult(
        handle,
        uploaded_bytes,
        sum(f.size for f in reused),
        len(uploaded) + len(private),
        len(reused),
    )


# ------------------------------------------------------------------ download
@dataclass(frozen=True)
class FetchResult:
    downloaded_files: int
    downloaded_bytes: int
    reused_files: int
    reused_bytes: int


def fetch_files(
    storage: CheckpointStorage,
    files: Iterable[StateFile],
    target_dir: str | os.PathLike[str],
    *,
    local_candidates: Mapping[str, list[Path]] | None = None,
    threads: int = 4,
    progress: Callable[[], None] | None = None,
) -> FetchResult:
    """Fetch ``files`` into ``target_dir`` under their local names, every one verified.

    A candidate local file with the same name, size and checksum (a worker restarting on the
    same host) is hard-linked instead of downloaded. A missing or corrupt file raises
    ``CorruptCheckpointError`` naming it; ``target_dir`` is then left partly filled for the
    caller to delete.
    """
    target = Path(target_dir)
    target.mkdir(parents=True, exist_ok=True)
    candidates = local_candidates or {}

    def fetch(state_file: StateFile) -> tuple[bool, int]:
        name = local_name(state_file.path)
        dest = target / name
        for candidate in candidates.get(name, []):
            try:
                if (
                    candidate.stat().st_size == state_file.size
                    and file_checksum(candidate) == state_file.checksum
                ):
                    _link_or_copy(candidate, dest)
                    return False, state_file.size
            except OSError:
                continue  # vanished or unreadable: download instead
        _download_verified(storage, state_file, dest)
        return True, state_file.size

    results: list[tuple[bool, int]] = []
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="state-fetch") as pool:
        for result in pool.map(fetch, files):
            results.append(result)
            if progress is not None:
                progress()  # a file fetched: the calling thread is not stalled
    down = [size for new, size in results if new]
    local = [size for new, size in results if not new]
    return FetchResult(len(down), sum(down), len(local), sum(local))


def _link_or_copy(source: Path, dest: Path) -> None:
    if dest.exists():
        dest.unlink()
    try:
        os.link(source, dest)
    except OSError:  # another filesystem, or links unsupported
        shutil.copyfile(source, dest)


def _download_verified(storage: CheckpointStorage, state_file: StateFile, dest: Path) -> None:
    """Stream one file to ``dest`` computing its CRC-32 on the way (one pass over the data)."""
    what = f"checkpoint file {state_file.path}"
    crc = 0
    size = 0
    try:
        with (
            storage.open_input(state_file.path) as src,
            open(dest, "wb") as out,
        ):
            while chunk := src.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
                size += len(chunk)
                out.write(chunk)
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(
            f"{what} is missing from checkpoint storage {redact_text(repr(storage.uri))}"
        ) from exc
    actual = f"crc32:{crc & 0xFFFFFFFF:08x}"
    if size != state_file.size or actual != state_file.checksum:
        raise CorruptCheckpointError(
            f"{what} is corrupt: {size} bytes with checksum {actual}, the checkpoint recorded "
            f"{state_file.size} bytes with {state_file.checksum}"
        )


# ------------------------------------------------------------------ retention
def discard_unreferenced_files(
    storage: CheckpointStorage, task_directory: str, retained: list[StateHandle]
) -> list[str]:
    """Delete the task's shared files that no retained checkpoint references; return their paths.

    Called by the runtime's retention step after checkpoint R committed, with the handles of
    the checkpoints it keeps (R among them). A shared file is deleted only if it is referenced
    by none of them AND was uploaded by a checkpoint with id <= R: a file uploaded by a newer,
    still in-flight checkpoint is not yet referenced by any committed handle and must survive.
    An in-flight checkpoint k > R reuses a file uploaded at j only if the file was live from j
    to k, so R (j <= R < k, same RocksDB instance) references it: the rule never deletes a file
    a later checkpoint needs. Files of aborted checkpoints go once a newer checkpoint commits.
    """
    if not retained:
        return []
    ids = [h.extra.get("checkpoint_id") for h in retained]
    if any(not isinstance(i, int) for i in ids):
        log.warning(
            "retention of %s skipped: a retained handle has no checkpoint id", task_directory
        )
        return []
    newest = max(int(i) for i in ids if i is not None)
    referenced = {f.path for h in retained for f in h.files}
    shared_dir = f"{task_directory.rstrip('/')}/{SHARED_DIR}"
    deleted = []
    for name in storage.list_dir(shared_dir):
        path = f"{shared_dir}/{name}"
        if path in referenced:
            continue
        parsed = parse_shared_file_name(name)
        if parsed is None or parsed[1] > newest:
            continue
        storage.delete_file(path)
        deleted.append(path)
    if deleted:
        log.info(
            "retention deleted %d unreferenced shared files of %s", len(deleted), task_directory
        )
    return deleted
