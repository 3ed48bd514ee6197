"""Migration 0004 adds the market history; its upsert works on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from batchyard.store import migrations
from batchyard.store.database import Database
from batchyard.store.market_history import load_history, save_history


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    url = (
        f"sqlite:///{tmp_path / 'fresh.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("pg_url")
    )
    database = Database(url, pool_size=2)
    try:
        yield database
    finally:
        database.close()


def test_0004_stores_history_upserts_and_downgrades_cleanly(db):
    db.migrate()
    assert "market_history" in inspect(db.engine).get_table_names()
    db.run_sync(lambda c: save_history(c, {"spot": [(100, 40.0), (101, None)]}))
    db.run_sync(lambda c: save_history(c, {"spot": [(101, 42.5)]}, keep_from=101))
    assert db.run_sync(lambda c: load_history(c, 0), readonly=True) == {"spot": [(101, 42.5)]}
    migrations.downgrade(db, "0003")
    assert "market_history" not in inspect(db.engine).get_table_names()
    db.migrate()
    assert db.run_sync(lambda c: load_history(c, 0), readonly=True) == {}
