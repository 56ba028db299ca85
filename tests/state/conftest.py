"""Fixtures of the state tests: every backend, fresh task directories, checkpoint storage."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from snapline.pipeline.checkpoint.storage import CheckpointStorage
from snapline.pipeline.state import BACKENDS, create_backend
from snapline.pipeline.state.backend import KeyedStateBackend


@pytest.fixture
def storage(tmp_path: Path) -> CheckpointStorage:
    return CheckpointStorage(str(tmp_path / "checkpoints"))


@pytest.fixture(params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_backend(backend_name: str, tmp_path: Path) -> Iterator[Callable[..., KeyedStateBackend]]:
    """Creates backends of the parametrized kind, each in its own task directory."""
    created: list[KeyedStateBackend] = []
    counter = itertools.count()

    def make(task_dir: Path | None = None, **options: Any) -> KeyedStateBackend:
        directory = task_dir or tmp_path / f"local-{next(counter)}"
        backend = create_backend(backend_name, task_dir=str(directory), options=options)
        created.append(backend)
        return backend

    yield make
    for backend in created:
        backend.close()


@pytest.fixture
def backend(make_backend: Callable[..., KeyedStateBackend]) -> KeyedStateBackend:
    return make_backend()


@pytest.fixture
def make_rocksdb(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Creates rocksdb backends (for the rocksdb-only tests)."""
    from snapline.pipeline.state.rocksdb import RocksDBStateBackend

    created: list[RocksDBStateBackend] = []
    counter = itertools.count()

    def make(task_dir: Path | None = None, **options: Any) -> RocksDBStateBackend:
        directory = task_dir or tmp_path / f"rocks-{next(counter)}"
        backend = RocksDBStateBackend(directory, **options)
        created.append(backend)
        return backend

    yield make
    for backend in created:
        backend.close()
