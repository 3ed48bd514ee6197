"""Migration 0015 gives file batches the one spelling of the cancel states, both ways."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import text

from batchyard.store.migrations import downgrade, upgrade
from batchyard.store.tables import organisations

STATES = ("in_progress", "cancelling", "cancelled", "completed")


def _statuses(db) -> list[str]:
    with db.engine.connect() as c:
        return list(c.execute(text("SELECT status FROM file_batches ORDER BY id")).scalars())


def test_0015_renames_cancelling_and_cancelled_rows_and_back(fresh_db):
    upgrade(fresh_db.engine, "0012")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    with fresh_db.engine.begin() as c:
        org = {"id": "org.1", "name": "acme", "tier": 0, "zero_data_retention": False}
        c.execute(organisations.insert().values(**org, created_at=now))
        for n, status in enumerate(STATES):
            c.execute(
                text(
                    "INSERT INTO file_batches (id, org_id, key_id, status, endpoint, "
                    "input_file_id, completion_window, request_count, max_cost, created_at, "
                    "expires_at) VALUES (:id, 'org.1', 'k.1', :status, '/v1/chat/completions', "
                    "'file.1', '24h', 1, 0, :now, :now)"
                ),
                {"id": f"bat.{n}", "status": status, "now": now},
            )

    upgrade(fresh_db.engine, "0015")
    assert _statuses(fresh_db) == ["in_progress", "canceling", "canceled", "completed"]
    downgrade(fresh_db.engine, "0012")
    assert _statuses(fresh_db) == list(STATES)
    upgrade(fresh_db.engine, "0015")
    assert _statuses(fresh_db) == ["in_progress", "canceling", "canceled", "completed"]
