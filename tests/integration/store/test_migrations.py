"""The migrations build exactly the schema the code declares, on SQLite and PostgreSQL."""

from __future__ import annotations

import importlib
import pkgutil

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

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
    with db.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(ctx, _declared_metadata())


def _tables(db: Database) -> set[str]:
    return set(inspect(db.engine).get_table_names()) - {"alembic_version"}


def test_upgrade_to_heads_matches_the_declared_schema(fresh_db):
    assert _tables(fresh_db) == set()
    fresh_db.migrate()
    assert _tables(fresh_db) == set(_declared_metadata().tables)
    diff = _diff(fresh_db)
    assert diff == [], diff
    fresh_db.migrate()  # a second upgrade is a no-op
    assert _diff(fresh_db) == []


def test_downgrade_to_base_and_up_again(fresh_db):
    fresh_db.migrate()
    migrations.downgrade(fresh_db.engine, "base")
    assert _tables(fresh_db) == set()
    fresh_db.migrate()
    assert _diff(fresh_db) == []
