"""Migration 0002 builds the run tables exactly as store.projects and store.runs declare them."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from batchyard.store import projects, runs
from batchyard.store.migrations import downgrade
from batchyard.store.tables import metadata

MINE = {
    "projects": projects.projects,
    "datasets": projects.datasets,
    "dataset_rows": projects.dataset_rows,
    "batch_inference_runs": runs.runs,
    "batch_inference_run_items": runs.run_items,
}


def _about_mine(diff) -> bool:
    """Whether an autogenerate diff entry concerns one of the run tables."""
    entries = diff if isinstance(diff, list) else [diff]
    for entry in entries:
        for part in entry:
            table = getattr(part, "table", part)
            if getattr(table, "name", part) in MINE:
                return True
    return False


def test_0002_creates_the_run_tables_with_their_declared_columns_and_indexes(fresh_db):
    fresh_db.migrate()
    insp = inspect(fresh_db.engine)
    assert set(MINE) <= set(insp.get_table_names())
    for name, table in MINE.items():
        assert {c["name"] for c in insp.get_columns(name)} == {c.name for c in table.columns}
        assert {i["name"] for i in insp.get_indexes(name)} >= {i.name for i in table.indexes}
    with fresh_db.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = [d for d in compare_metadata(ctx, metadata) if _about_mine(d)]
    assert diff == [], diff


def test_0002_downgrades_and_upgrades_again(fresh_db):
    fresh_db.migrate()
    downgrade(fresh_db.engine, "0001")
    assert not set(MINE) & set(inspect(fresh_db.engine).get_table_names())
    fresh_db.migrate()
    assert set(MINE) <= set(inspect(fresh_db.engine).get_table_names())
