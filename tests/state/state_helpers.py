"""Helpers of the state tests: bind descriptors to a backend, take checkpoints like the runtime."""

from __future__ import annotations

from typing import Any

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.keygroups import key_group, state_key_prefix
from snapline.pipeline.state.backend import KeyedStateBackend, StateHandle
from snapline.pipeline.state.descriptors import KeyScope, StateDescriptor

JOB = "job"
MAX_PARALLELISM = 128


class Keyed:
    """Binds descriptors to one backend and switches the current key, like the keyed operator."""

    def __init__(self, backend: KeyedStateBackend) -> None:
        self.backend = backend
        self.scope = KeyScope()

    def bind(self, descriptor: StateDescriptor, state_id: int) -> Any:
        return descriptor.bind(self.backend, self.scope, state_id)

    def at(self, key: str) -> Keyed:
        raw = key.encode()
        self.scope.prefix = state_key_prefix(key_group(raw, MAX_PARALLELISM), raw)
        self.scope.key = key
        return self


def checkpoint_directory(task: str, checkpoint_id: int, attempt: str = "a1b2c3d4") -> str:
    """The directory the runtime passes to ``materialize``."""
    return f"{JOB}/tasks/{task}/chk-{checkpoint_id:010d}-{attempt}"


def take_checkpoint(
    backend: KeyedStateBackend, storage: CheckpointStorage, checkpoint_id: int, task: str = "t0"
) -> StateHandle:
    """Synchronous part, materialize, release: what the runtime does for one checkpoint."""
    snapshot = backend.snapshot(checkpoint_id)
    try:
        return snapshot.materialize(storage, checkpoint_directory(task, checkpoint_id))
    finally:
        snapshot.release()
