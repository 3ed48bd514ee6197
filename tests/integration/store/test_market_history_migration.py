"""Migration 0004 adds the market history; its upsert works on SQLite and PostgreSQL."""

from __future__ import annotations

from sqlalchemy import inspect

from batchyard.store import migrations
from batchyard.store.market_history import load_history, save_history


def test_0004_stores_history_upserts_and_downgrades_cleanly(fresh_db):
    fresh_db.migrate()
    assert "market_history" in inspect(fresh_db.engine).get_table_names()
    fresh_db.transact_sync(lambda c: save_history(c, {"spot": [(100, 40.0), (101, None)]}))
    fresh_db.transact_sync(lambda c: save_history(c, {"spot": [(101, 42.5)]}, keep_from=101))
    assert fresh_db.read_sync(lambda c: load_history(c, 0)) == {"spot": [(101, 42.5)]}
    migrations.downgrade(fresh_db.engine, "0003")
    assert "market_history" not in inspect(fresh_db.engine).get_table_names()
    fresh_db.migrate()
    assert fresh_db.read_sync(lambda c: load_history(c, 0)) == {}
