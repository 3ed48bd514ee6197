"""The migrations build exactly the schema the code declares, on SQLite and PostgreSQL.

Exactly: every table, column type, index, constraint and server default, as
Alembic's autogenerate comparison sees them, so a table added to a store
module without its migration (or the reverse) fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
from datetime import UTC, datetime

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

import batchyard.store
from batchyard.store import migrations
from batchyard.store.database import Database
from batchyard.store.tables import metadata


def _declared_metadata():
    """Every table any store module declares, as ``migrations/env.py`` should see them."""
    for mod in pkgutil.iter_modules(batchyard.store.__path__, "batchyard.store."):
        if not mod.name.endswith(".migrations"):
            importlib.import_module(mod.name)
    return metadata


def _diff(db: Database) -> list[object]:
    opts = {"compare_type": True, "compare_server_default": True}
    with db.engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn, opts=opts), _declared_metadata())


def _tables(db: Database) -> set[str]:
    return set(inspect(db.engine).get_table_names()) - {"alembic_version"}


def _revisions(db: Database) -> set[str]:
    with db.engine.connect() as conn:
        return {r[0] for r in conn.execute(text("SELECT version_num FROM alembic_version"))}


def test_upgrade_to_heads_matches_the_declared_schema(fresh_db):
    assert _tables(fresh_db) == set()
    fresh_db.migrate()
    assert _tables(fresh_db) == set(_declared_metadata().tables)
    diff = _diff(fresh_db)
    assert diff == [], diff
    with fresh_db.engine.connect() as conn:
        assert migrations.behind(conn) is None  # what /readyz asks
    fresh_db.migrate()  # a second upgrade is a no-op
    assert _diff(fresh_db) == []


def test_downgrade_to_base_and_up_again(fresh_db):
    fresh_db.migrate()
    migrations.downgrade(fresh_db.engine, "base")
    assert _tables(fresh_db) == set()
    assert _revisions(fresh_db) == set()
    fresh_db.migrate()
    assert _diff(fresh_db) == []


def test_a_row_written_without_the_defaulted_columns_gets_the_server_defaults(fresh_db):
    """What a raw SQL insert (an operator's, or an older process's) leaves out is filled in."""
    fresh_db.migrate()
    now = datetime(2026, 1, 1, tzinfo=UTC)
    with fresh_db.engine.begin() as c:
        c.execute(
            text(
                "INSERT INTO organisations (id, name, tier, zero_data_retention, created_at) "
                "VALUES ('org.1', 'acme', 0, false, :now)"
            ),
            {"now": now},
        )
        c.execute(
            text(
                "INSERT INTO projects (id, org_id, name, created_at, updated_at) "
                "VALUES ('p.1', 'org.1', 'p', :now, :now)"
            ),
            {"now": now},
        )
        c.execute(
            text(
                "INSERT INTO datasets (id, org_id, project_id, name, kind, row_count, fields, "
                "created_at, updated_at) VALUES ('d.1', 'org.1', 'p.1', 'd', 'text', 0, '[]', "
                ":now, :now)"
            ),
            {"now": now},
        )
        ready = c.execute(text("SELECT ready FROM datasets")).scalar_one()
    assert ready in (True, 1)
