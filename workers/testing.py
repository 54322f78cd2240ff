"""pytest fixtures for tests that run real workers (import them into a test module).

The worker environment and the tiny model are built once into the cache
(outside the repository) and reused by every later run.
"""

from __future__ import annotations

import pytest

from .envpath import worker_python as _worker_python
from .tinymodel import ensure


@pytest.fixture(scope="session")
def worker_python() -> str:
    return _worker_python()


@pytest.fixture(scope="session")
def tiny_model(worker_python) -> str:
    return str(ensure(worker_python))
