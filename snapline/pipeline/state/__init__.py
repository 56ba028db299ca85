"""Keyed state: descriptors, serdes and the backends behind them."""

from __future__ import annotations

from snapline.pipeline.errors import ConfigurationError
from snapline.pipeline.state.backend import KeyedStateBackend

BACKENDS = ("memory", "rocksdb")


def create_backend(
    name: str, *, task_dir: str | None = None, options: dict[str, object] | None = None
) -> KeyedStateBackend:
    """A fresh backend for one task. ``task_dir`` is the task's local working directory."""
    if name == "memory":
        from snapline.pipeline.state.memory import MemoryStateBackend

        return MemoryStateBackend()
    if name == "rocksdb":
        try:
            from snapline.pipeline.state.rocksdb import RocksDBStateBackend
        except ImportError as exc:
            raise ConfigurationError(f"the rocksdb state backend is unavailable: {exc}") from exc
        if task_dir is None:
            raise ConfigurationError("the rocksdb state backend needs a local task directory")
        return RocksDBStateBackend(task_dir, **(options or {}))
    raise ConfigurationError(f"unknown state_backend {name!r}; use one of {list(BACKENDS)}")
