"""The market history is kept per route; its upsert works on SQLite and PostgreSQL."""

from __future__ import annotations

from sqlalchemy import inspect

from batchyard.store.market_history import load_history, save_history


def _columns(db) -> set[str]:
    return {c["name"] for c in inspect(db.engine).get_columns("market_history")}


def test_history_is_kept_per_route_and_upserted(fresh_db):
    fresh_db.migrate()
    assert _columns(fresh_db) == {"route", "slot", "discount"}
    fresh_db.transact_sync(lambda c: save_history(c, {"spot": [(100, 40.0), (101, None)]}))
    fresh_db.transact_sync(lambda c: save_history(c, {"spot": [(101, 42.5)]}, keep_from=101))
    assert fresh_db.read_sync(lambda c: load_history(c, 0)) == {"spot": [(101, 42.5)]}
