"""Migration 0010 gives every leased object a fencing token; rows already there start at 0."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import inspect, text

from batchyard.store.migrations import downgrade, upgrade
from tests.integration.store.conftest import add_deferred_item

LEASED = ("batch_inference_runs", "file_batch_lines", "batch_items")


def _columns(db, table: str) -> set[str]:
    return {c["name"] for c in inspect(db.engine).get_columns(table)}


def test_0010_adds_lease_token_to_each_leased_table_and_existing_rows_start_at_zero(fresh_db):
    upgrade(fresh_db.engine, "0009")
    assert all("lease_token" not in _columns(fresh_db, t) for t in LEASED)
    now = datetime(2026, 1, 1, tzinfo=UTC)
    add_deferred_item(fresh_db.engine, now)

    upgrade(fresh_db.engine, "0010")
    assert all("lease_token" in _columns(fresh_db, t) for t in LEASED)
    with fresh_db.engine.connect() as c:
        assert c.execute(text("SELECT lease_token FROM batch_items")).scalar_one() == 0

    downgrade(fresh_db.engine, "0009")
    assert all("lease_token" not in _columns(fresh_db, t) for t in LEASED)
    with fresh_db.engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM batch_items")).scalar_one() == 1
    upgrade(fresh_db.engine, "0010")
    assert all("lease_token" in _columns(fresh_db, t) for t in LEASED)
