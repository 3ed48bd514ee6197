"""Alembic environment: runs on the connection handed in by ``upgrade``."""

from __future__ import annotations

from alembic import context

# Upgrades run the scripts and need no metadata. Autogenerate (the schema test)
# needs every table: it imports each store module first, since importing them
# here would tie this package to the modules that migrate through it.
from batchyard.store.tables import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
