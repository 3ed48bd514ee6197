"""Alembic migrations, applied on start (``Database.migrate``).

Alembic is driven from code, not from an ini file: the script directory is
this package, and the connection is handed in, so the server, the CLI and the
tests all migrate the same way on SQLite and PostgreSQL. On PostgreSQL an
advisory lock keeps two workers starting at once from racing each other.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, text

__all__ = ["alembic_config", "upgrade"]

_HERE = Path(__file__).parent
_LOCK_ID = 7_215_004_113


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_HERE))
    return cfg


def upgrade(engine: Engine, revision: str = "heads") -> None:
    cfg = alembic_config()
    locking = engine.dialect.name == "postgresql"
    with engine.connect() as conn:
        if locking:
            conn.execute(text("SELECT pg_advisory_lock(:id)"), {"id": _LOCK_ID})
            conn.commit()
        try:
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
