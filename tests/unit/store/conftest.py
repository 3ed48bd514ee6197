"""An in-memory SQLite store per test: the unit tier's database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from batchyard.store.database import Database


def memory_database() -> Database:
    db = Database("sqlite://", pool_size=1)
    db.migrate()
    return db


@pytest.fixture
def db() -> Iterator[Database]:
    database = memory_database()
    try:
        yield database
    finally:
        database.close()
