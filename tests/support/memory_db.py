"""In-memory SQLite stores copied from one migrated template: the unit tier's database.

Migrating a fresh in-memory store runs every Alembic step (about 0.14 s on
the 2-core machine); copying the pages of a store migrated once per process
with SQLite's backup API takes about 0.01 s. Each copy is its own database,
so tests stay independent while the unit tier stays fast.
"""

from __future__ import annotations

import threading

from batchyard.store.database import Database

__all__ = ["memory_copy"]

_template: Database | None = None
_template_lock = threading.Lock()


def _migrated_template() -> Database:
    global _template
    with _template_lock:
        if _template is None:
            template = Database("sqlite://", pool_size=1)
            template.migrate()
            _template = template
        return _template


def memory_copy() -> Database:
    """A fresh in-memory store holding the migrated schema; the caller closes it."""
    template = _migrated_template()
    db = Database("sqlite://", pool_size=1)
    source = template.engine.raw_connection()
    target = db.engine.raw_connection()
    try:
        source.driver_connection.backup(target.driver_connection)  # type: ignore[union-attr]
    finally:
        target.close()
        source.close()
    return db
