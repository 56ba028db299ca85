"""One live process per worker's local directory.

A worker deletes local files it can prove dead: the task directories of tasks that moved to
another worker (``Worker._remove_moved_task_dirs``) and the files of its earlier incarnations
(``RocksDBBackend``). That proof is "nobody else writes here", and this lock makes it true:
each worker keeps its files under ``<local dir>/<worker id>/<job>/`` and holds
``<local dir>/<worker id>/<job>.lock`` while it lives.

A second process with the same worker id on the same host (two services left at the default
id, the hostname; a worker orphaned by a killed supervisor) waits ``LOCK_WAIT`` seconds for the
first to exit, then fails at start with the fix, instead of deleting the first one's live
RocksDB files and fencing it in Kafka.

POSIX record locks (``lockf``), not ``flock``: the kernel drops them when the process dies,
SIGKILL included, and a child the worker forked does not inherit them, so a dead worker's
child cannot keep its successor out. The lock file stays on disk; only the lock matters.

The lock covers one host, so the directory must be one host's own. On a filesystem that other
hosts mount too (NFS, SMB, CephFS...: ``shared_filesystem``), two hosts' processes with one
worker id (a frozen worker and its replacement) would use the same directory, and whether
one's lock keeps the other out is the filesystem's to say (NFS drops the lock of a client that
was silent past its lease; ``nolock`` mounts keep none): the replacement could move the frozen
one's live RocksDB files away, and the woken one write into the replacement's. So the default
local directory is never put beside a checkpoint directory on such a filesystem, and a
``--local-dir`` on one is warned about at start.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from snapline.pipeline.errors import ConfigurationError

log = logging.getLogger(__name__)

#: Seconds a new worker waits for a process with its id to exit: at least the worker's
#: STOP_BOUND (30 s), the longest a worker told to stop (SIGTERM, or its supervisor's death)
#: takes for its final checkpoint. Orchestrators start a restarted worker once the old
#: process is gone; this covers a stop still in progress.
LOCK_WAIT = 35.0
#: Overrides LOCK_WAIT (seconds): where an orchestrator gives a stopping worker longer, or a
#: test does not want to wait for a refusal.
LOCK_WAIT_ENV = "SNAPLINE_LOCAL_LOCK_WAIT"
_POLL = 0.2
#: Filesystem types (as /proc/self/mountinfo names them) whose files other hosts may open too.
SHARED_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ocfs2",
        "gfs2",
        "afs",
        "9p",
        "fuse.glusterfs",
        "fuse.ceph",
        "fuse.ceph-fuse",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.juicefs",
        "fuse.rclone",
        "fuse.mountpoint-s3",
        "fuse.blobfuse2",
    }
)
_MOUNTINFO = Path("/proc/self/mountinfo")


def mount_type(path: Path, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` (or its nearest existing ancestor) is on, by the
    longest mount point that holds it in ``mountinfo`` (default: /proc/self/mountinfo); None
    where that cannot be read (not Linux)."""
    if mountinfo is None:
        try:
            mountinfo = _MOUNTINFO.read_text()
        except OSError:
            return None
    target = Path(os.path.realpath(path))
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)  # the optional fields end at it; fields[4] is before
        if len(fields) <= separator + 1:
            continue
        point = Path(_unescape(fields[4]))
        if target == point or point in target.parents:
            depth = len(point.parts)
            if best is None or depth >= best[0]:  # a later mount over the same point wins
                best = (depth, fields[separator + 1])
    return None if best is None else best[1]


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def shared_filesystem(path: Path) -> str | None:
    """The type of the filesystem ``path`` is on when other hosts may mount it too
    (``SHARED_FILESYSTEMS``), else None."""
    kind = mount_type(path)
    return kind if kind in SHARED_FILESYSTEMS else None


def lock_wait() -> float:
    """LOCK_WAIT, or ``SNAPLINE_LOCAL_LOCK_WAIT`` when set (ConfigurationError when it is not a
    number of seconds ≥ 0)."""
    raw = os.environ.get(LOCK_WAIT_ENV)
    if raw is None or raw == "":
        return LOCK_WAIT
    try:
        wait = float(raw)
    except ValueError:
        wait = -1.0
    if not wait >= 0:  # also NaN
        raise ConfigurationError(
            f"{LOCK_WAIT_ENV}={raw!r} must be a number of seconds ≥ 0 (default {LOCK_WAIT:.0f})"
        )
    return wait


def lock_local_dir(root: Path, job: str, worker_id: str, wait: float = LOCK_WAIT) -> int:
    """Take ``root/<job>.lock`` for this process; returns the descriptor to keep open for the
    process's lifetime (closing it releases the lock). ConfigurationError when another live
    process still holds it after ``wait`` seconds."""
    path = root / f"{job}.lock"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot use {root} for worker {worker_id!r}'s local state: {exc}. Point "
            "--local-dir (SNAPLINE_LOCAL_DIR) at a writable local directory"
        ) from exc
    deadline = time.monotonic() + wait
    warned = False
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
        # Read through our own descriptor: opening and closing another one on this file would
        # drop a POSIX lock this process holds (none yet, but keep the rule simple).
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        if time.monotonic() >= deadline:
            os.close(fd)
            raise ConfigurationError(
                f"worker {worker_id!r} of job {job!r} is already running on this host "
                f"({holder}): its local directory {root} is locked (waited {wait:.0f} s). "
                "Each worker needs its own --worker-id (the id is also its Kafka "
                "transactional id and group member id: two processes with one id fence each "
                "other). Stop the other process, or start this one with another --worker-id"
            )
        if not warned:
            log.warning(
                "local directory %s is locked by %s; waiting up to %.0f s for it to exit",
                root,
                holder,
                wait,
            )
            warned = True
        time.sleep(_POLL)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd
