"""The skeleton of a staging sink writer: stage each checkpoint on a background thread, publish
it in order on commit, discard it on abort (the shape of the Parquet and PostgreSQL writers).

Threads: the task thread runs every public method and the hooks ``_take``, ``_publish``,
``_discard``, ``_drop_buffered`` and ``_recover_staged``. One background thread per writer (a
FIFO executor) runs ``_stage`` on the immutable job that ``_take`` handed over, then anything a
subclass queues with ``_call``, in submission order.
"""

from __future__ import annotations

import contextlib
import errno
from abc import abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from snapline.pipeline.errors import SinkError, SinkUnavailableError, first_in_chain
from snapline.pipeline.sink import PreCommitResult, SinkWriter

__all__ = ["METADATA_FORMAT", "Staged", "StagingSinkWriter"]

#: Version of the checkpoint metadata a staging writer returns from ``pre_commit``.
METADATA_FORMAT = 1

#: ``errno`` of an ``OSError`` that says the sink's storage cannot be reached (a network
#: filesystem's server gone, a connection to an object store lost), not that it refused.
#: EIO is not among them: a soft NFS mount returns it on a timeout, but so does a failing
#: local disk, which restarts would not fix.
UNREACHABLE_ERRNOS = frozenset(
    {
        errno.ESTALE,
        errno.ENOTCONN,
        errno.ETIMEDOUT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EHOSTDOWN,
        errno.EHOSTUNREACH,
        errno.ENETDOWN,
        errno.ENETUNREACH,
        errno.ENETRESET,
    }
)

_T = TypeVar("_T")
J = TypeVar("J")  # what the task thread hands the background thread for one pre-commit


class Staged(Protocol):
    """What staging one checkpoint produced: enough to publish it, as checkpoint metadata."""

    @property
    def checkpoint_id(self) -> int: ...

    def to_json(self) -> dict[str, Any]: ...


S = TypeVar("S", bound=Staged)


@dataclass
class _Pending(Generic[S]):
    """A checkpoint handed to the background thread and not yet published."""

    checkpoint_id: int
    future: Future[S]


class StagingSinkWriter(SinkWriter, Generic[J, S]):
    """Two-phase commit through staging: ``pre_commit(n)`` stages epochs ≤ n in the background
    and returns a future of the metadata listing every staged, unpublished checkpoint;
    ``commit(n)`` publishes staged checkpoints ≤ n oldest first; ``abort(n)`` discards this
    writer's staged checkpoints ≥ n; ``recover`` waits for the background thread, forgets
    everything in memory and leaves what is stored to ``_recover_staged``.

    Subclasses buffer rows per epoch in ``write``/``write_batch`` and fill in the hooks."""

    #: What a staging holds, for messages ("files", "rows").
    staged_noun = "data"

    def __init__(self, sink_name: str, thread_name: str) -> None:
        self._sink_name = sink_name
        self._thread_name = thread_name
        self._pending: list[_Pending[S]] = []
        self._executor: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _take(self, checkpoint_id: int) -> J | None:
        """Task thread: remove the buffered output of epochs ≤ n and return it as an immutable
        staging job (None: nothing buffered)."""

    @abstractmethod
    def _stage(self, job: J) -> S:
        """Background thread: make the job durable but invisible to readers."""

    @abstractmethod
    def _publish(self, staged: S) -> None:
        """Task thread: make a staged checkpoint visible. Idempotent."""

    @abstractmethod
    def _discard(self, checkpoint_ids: Sequence[int], from_checkpoint: int) -> None:
        """Task thread, on abort: delete this writer's staged checkpoints ≥ ``from_checkpoint``
        (``checkpoint_ids`` were handed to the background thread; their staging is over)."""

    @abstractmethod
    def _drop_buffered(self, from_epoch: int | None = None) -> None:
        """Task thread: forget buffered epochs ≥ ``from_epoch`` (None: all of them)."""

    @abstractmethod
    def _recover_staged(self, committed: int | None, metadata: dict[str, Any] | None) -> None:
        """Task thread, with nothing pending: publish what ``committed`` names, delete only
        what is provably dead (docs/exactly-once.md, "What may be deleted")."""

    def _close_background(self) -> None:  # noqa: B027 - default no-op
        """Background thread, last task before it stops: release what it owns."""

    # ------------------------------------------------------------------ two-phase commit
    def pre_commit(self, checkpoint_id: int) -> PreCommitResult:
        """Hand epochs ≤ n to the background thread, which stages them durably."""
        job = self._take(checkpoint_id)
        if job is None and not self._pending:
            return {"format": METADATA_FORMAT, "pending": []}
        if job is not None:
            future = self._pool().submit(self._reachable, self._stage, job)
            self._pending.append(_Pending(checkpoint_id, future))
        return _metadata_future([p.future for p in self._pending])

    def commit(self, checkpoint_id: int) -> None:
        """Publish every staged checkpoint ≤ n, oldest first."""
        while self._pending and self._pending[0].checkpoint_id <= checkpoint_id:
            pending = self._pending[0]
            try:
                staged = pending.future.result()
            except Exception as exc:
                raise SinkError(
                    f"{self._sink_name}: checkpoint {pending.checkpoint_id} was committed but "
                    f"its {self.staged_noun} were never staged: {exc}"
                ) from exc
            self._reachable(self._publish, staged)
            self._pending.pop(0)

    def abort(self, checkpoint_id: int) -> None:
        """Drop buffered epochs ≥ n and discard this writer's staged checkpoints ≥ n."""
        aborted = [p for p in self._pending if p.checkpoint_id >= checkpoint_id]
        self._pending = [p for p in self._pending if p.checkpoint_id < checkpoint_id]
        self._drop_buffered(checkpoint_id)
        for pending in aborted:
            with contextlib.suppress(Exception):
                pending.future.result()
        if aborted:
            self._discard([p.checkpoint_id for p in aborted], checkpoint_id)

    def recover(self, committed: int | None, metadata: dict[str, Any] | None) -> None:
        """Forget what is in memory, then recover what is stored (``_recover_staged``)."""
        self._drain()
        self._pending = []
        self._drop_buffered()
        self._reachable(self._recover_staged, committed, metadata)

    def close(self) -> None:
        self._drain()
        self._drop_buffered()
        if self._executor is not None:
            with contextlib.suppress(Exception):
                self._executor.submit(self._close_background).result()
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ the background thread
    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._thread_name)
        return self._executor

    def _drain(self) -> None:
        """Wait until every handed-over staging is over (succeeded or failed)."""
        for pending in self._pending:
            with contextlib.suppress(Exception):
                pending.future.result()

    def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn`` on the background thread (after queued stagings) and wait for it."""
        return self._pool().submit(self._reachable, fn, *args).result()

    def _reachable(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, its storage's outage raised as ``SinkUnavailableError``: the worker
        then exits 75 and is restarted with backoff (recovering the committed checkpoint and
        publishing what it staged) instead of counting as a crash that stops the job."""
        try:
            return fn(*args)
        except SinkUnavailableError:
            raise
        except Exception as exc:
            if not unreachable(exc):
                raise
            raise SinkUnavailableError(
                f"{self._sink_name}: its storage cannot be reached: {exc}"
            ) from exc


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from, is an ``OSError`` that says a storage
    cannot be reached (UNREACHABLE_ERRNOS), not that it refused (permissions, a full disk, a
    missing directory)."""
    found = first_in_chain(exc, lambda e: isinstance(e, OSError) and e.errno in UNREACHABLE_ERRNOS)
    return found is not None


def _metadata_future(futures: Sequence[Future[S]]) -> Future[dict[str, Any]]:
    """A future of the checkpoint metadata: every staged-but-unpublished checkpoint, done when
    all of them are durable. One FIFO background thread runs the stagings, so when the last
    future is done the earlier ones are too, and the callback never blocks."""
    result: Future[dict[str, Any]] = Future()

    def done(_: Future[S]) -> None:
        try:
            staged = [f.result() for f in futures]
        except Exception as exc:
            result.set_exception(exc)
            return
        result.set_result({"format": METADATA_FORMAT, "pending": [s.to_json() for s in staged]})

    futures[-1].add_done_callback(done)
    return result
