"""Alembic environment: runs on the connection handed in by ``upgrade``."""

from __future__ import annotations

from alembic import context

# Every module that puts tables on the shared metadata, so that autogenerate
# and the schema test see them all.
from batchyard.store.tables import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
