"""Migration 0013 gives a deferred item the lease every leased row has; its rows keep their lease.

A deferred item named its lease's expiry ``lease_until`` and kept no owner;
runs and file-batch lines had ``lease_owner`` and ``lease_expires_at``. After
0013 all three are one shape (``store.leases``). An item dispatched before the
upgrade keeps its expiry and token and has no owner (its worker was the old
code's), so only recovery can end it; the downgrade gives the expiry back
under its old name.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import inspect, text

from batchyard.store.migrations import downgrade, upgrade
from tests.integration.store.conftest import add_deferred_item

LEASED = ("batch_inference_runs", "file_batch_lines", "batch_items")
ONE_LEASE = {"lease_owner", "lease_expires_at", "lease_token"}


def _at(value: object) -> datetime:
    """A stored time as an aware UTC datetime (SQLite hands raw SQL a string)."""
    at = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)


def _columns(db, table: str) -> set[str]:
    return {c["name"] for c in inspect(db.engine).get_columns(table)}


def test_0013_renames_the_item_lease_adds_its_owner_and_keeps_existing_rows(fresh_db):
    upgrade(fresh_db.engine, "0012")
    assert "lease_until" in _columns(fresh_db, "batch_items")
    assert not _columns(fresh_db, "batch_items") >= ONE_LEASE
    now = datetime(2026, 1, 1, tzinfo=UTC)
    expiry = now + timedelta(minutes=2)
    add_deferred_item(
        fresh_db.engine, now, reservation_id="res.1", lease_until=expiry, lease_token=3
    )

    upgrade(fresh_db.engine, "0013")
    assert all(_columns(fresh_db, t) >= ONE_LEASE for t in LEASED)
    assert "lease_until" not in _columns(fresh_db, "batch_items")
    with fresh_db.engine.connect() as c:
        row = c.execute(
            text(
                "SELECT status, reservation_id, lease_owner, lease_expires_at, lease_token "
                "FROM batch_items WHERE id = 'i.1'"
            )
        ).one()
    assert (row.status, row.reservation_id, row.lease_owner, row.lease_token) == (
        "dispatched",
        "res.1",
        None,
        3,
    )
    assert _at(row.lease_expires_at) == expiry

    downgrade(fresh_db.engine, "0012")
    assert "lease_until" in _columns(fresh_db, "batch_items")
    assert not {"lease_owner", "lease_expires_at"} & _columns(fresh_db, "batch_items")
    with fresh_db.engine.connect() as c:
        back = c.execute(
            text("SELECT lease_until, lease_token FROM batch_items WHERE id = 'i.1'")
        ).one()
    assert (_at(back.lease_until), back.lease_token) == (expiry, 3)

    upgrade(fresh_db.engine, "0013")
    assert _columns(fresh_db, "batch_items") >= ONE_LEASE
