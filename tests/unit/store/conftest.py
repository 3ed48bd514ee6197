"""An in-memory SQLite store per test: the unit tier's database (a copy of one migrated once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from batchyard.store.database import Database
from tests.support.memory_db import memory_copy


@pytest.fixture
def db() -> Iterator[Database]:
    database = memory_copy()
    try:
        yield database
    finally:
        database.close()
