"""Migration 0003 creates the deferred-batch tables on SQLite and PostgreSQL."""

from __future__ import annotations

from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from batchyard.store import migrations


def test_0003_creates_batches_and_items_and_downgrades_cleanly(fresh_db):
    migrations.upgrade(fresh_db.engine, "0003")
    insp = inspect(fresh_db.engine)
    assert {"batches", "batch_items"} <= set(insp.get_table_names())
    cols = {c["name"] for c in insp.get_columns("batch_items")}
    assert {"body", "result", "reservation_id", "lease_until", "key_id", "custom_id"} <= cols
    assert {i["name"] for i in insp.get_indexes("batch_items")} >= {
        "ix_batch_items_status",
        "ix_batch_items_org",
    }
    fresh_db.migrate()
    with fresh_db.engine.connect() as conn:
        heads = {r[0] for r in conn.execute(text("SELECT version_num FROM alembic_version"))}
    # The latest (0003 is under it): whichever revision is the scripts' one head.
    assert heads == set(ScriptDirectory.from_config(migrations.alembic_config()).get_heads())
    assert len(heads) == 1
    migrations.downgrade(fresh_db.engine, "0001")
    assert not {"batches", "batch_items"} & set(inspect(fresh_db.engine).get_table_names())
    fresh_db.migrate()
    assert {"batches", "batch_items"} <= set(inspect(fresh_db.engine).get_table_names())
