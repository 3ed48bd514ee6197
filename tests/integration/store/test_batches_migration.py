"""Migration 0003 creates the deferred-batch tables on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text

from batchyard.store import migrations
from batchyard.store.database import Database


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


def test_0003_creates_batches_and_items_and_downgrades_cleanly(db):
    db.migrate()
    insp = inspect(db.engine)
    assert {"batches", "batch_items"} <= set(insp.get_table_names())
    cols = {c["name"] for c in insp.get_columns("batch_items")}
    assert {"body", "result", "reservation_id", "lease_until", "key_id", "custom_id"} <= cols
    assert {i["name"] for i in insp.get_indexes("batch_items")} >= {
        "ix_batch_items_status",
        "ix_batch_items_org",
    }
    with db.engine.connect() as conn:
        heads = {r[0] for r in conn.execute(text("SELECT version_num FROM alembic_version"))}
    assert heads == {"0004"}  # the latest; 0003 is under it
    migrations.downgrade(db, "0001")
    assert not {"batches", "batch_items"} & set(inspect(db.engine).get_table_names())
    db.migrate()
    assert {"batches", "batch_items"} <= set(inspect(db.engine).get_table_names())
