"""An empty database per test, on SQLite and on PostgreSQL: what migrations start from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from batchyard.store.database import Database


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'fresh.db'}"
    else:
        url = request.getfixturevalue("pg_empty_url")
    db = Database(url, pool_size=2)
    try:
        yield db
    finally:
        db.close()
