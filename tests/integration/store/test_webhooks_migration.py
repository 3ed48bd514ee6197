"""Migration 0016 adds the webhook endpoints and their outbox, and takes them away again."""

from __future__ import annotations

from sqlalchemy import inspect

from batchyard.store.migrations import downgrade, upgrade


def _tables(db) -> set[str]:
    return set(inspect(db.engine).get_table_names())


def _columns(db, table: str) -> set[str]:
    return {c["name"] for c in inspect(db.engine).get_columns(table)}


def test_0016_creates_the_endpoints_and_the_leased_outbox_and_drops_them(fresh_db):
    upgrade(fresh_db.engine, "0015")
    assert not {"webhook_endpoints", "webhook_deliveries"} & _tables(fresh_db)
    upgrade(fresh_db.engine, "0016")
    assert {"webhook_endpoints", "webhook_deliveries"} <= _tables(fresh_db)
    lease = {"lease_owner", "lease_expires_at", "lease_token", "sent_at"}
    assert lease <= _columns(fresh_db, "webhook_deliveries")
    assert {"secret", "events", "deleted_at"} <= _columns(fresh_db, "webhook_endpoints")
    downgrade(fresh_db.engine, "0015")
    assert not {"webhook_endpoints", "webhook_deliveries"} & _tables(fresh_db)
    upgrade(fresh_db.engine, "0016")
    assert {"webhook_endpoints", "webhook_deliveries"} <= _tables(fresh_db)
