"""Alembic migrations, applied on start (``Database.migrate``).

Alembic is driven from code, not from an ini file: the script directory is
this package, and the connection is handed in, so the server, the CLI and the
tests all migrate the same way on SQLite and PostgreSQL. On PostgreSQL an
advisory lock keeps two workers starting at once from racing each other.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, text

from batchyard.core.config_errors import ConfigError

__all__ = ["alembic_config", "behind", "upgrade"]

_HERE = Path(__file__).parent
_LOCK_ID = 7_215_004_113


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_HERE))
    return cfg


@cache
def _heads() -> frozenset[str]:
    """The revisions this code's migrations end at (read once: they do not change)."""
    return frozenset(ScriptDirectory.from_config(alembic_config()).get_heads())


@cache
def _known() -> frozenset[str]:
    """Every revision this code's migrations hold."""
    script = ScriptDirectory.from_config(alembic_config())
    return frozenset(rev.revision for rev in script.walk_revisions())


def _refuse_unknown(conn: Connection) -> None:
    """A database another batchyard migrated: one line for the operator, not Alembic's trace.

    A newer release's database, or a development build's from before 0.1.0
    folded its migrations into one, is at a revision this code cannot
    upgrade from (nor should it guess at the schema).
    """
    unknown = sorted(set(MigrationContext.configure(conn).get_current_heads()) - _known())
    if unknown:
        url = conn.engine.url
        aside = (
            f"move {url.database} aside"
            if url.get_backend_name() == "sqlite"
            else f"not {url.database}: create another"
        )
        raise ConfigError(
            "database_url",
            f"the database is at revision {', '.join(unknown)}, which this batchyard does not "
            "know (a newer release, or a development build before 0.1.0, migrated it)",
            f"use a new database ({aside}) or run the batchyard that migrated it",
        )


def behind(conn: Connection) -> str | None:
    """Why the database's schema is not this code's head, or None when it is.

    ``/readyz`` asks this: a process whose database was migrated by older or
    newer code must not take traffic.
    """
    current = frozenset(MigrationContext.configure(conn).get_current_heads())
    if current == _heads():
        return None
    return (
        f"the database is at revision {', '.join(sorted(current)) or 'none'}; "
        f"this code needs {', '.join(sorted(_heads()))}"
    )


def upgrade(engine: Engine, revision: str = "heads") -> None:
    cfg = alembic_config()
    locking = engine.dialect.name == "postgresql"
    with engine.connect() as conn:
        if locking:
            conn.execute(text("SELECT pg_advisory_lock(:id)"), {"id": _LOCK_ID})
            conn.commit()
        try:
            _refuse_unknown(conn)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
            conn.commit()
        finally:
            if locking:
                conn.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": _LOCK_ID})
                conn.commit()


def downgrade(engine: Engine, revision: str) -> None:
    cfg = alembic_config()
    with engine.connect() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
        conn.commit()
