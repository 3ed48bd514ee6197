"""An empty database per test, on SQLite and on PostgreSQL: what migrations start from."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, text

from batchyard.store.database import Database


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'fresh.db'}"
    else:
        url = request.getfixturevalue("pg_empty_url")
    db = Database(url, pool_size=2)
    try:
        yield db
    finally:
        db.close()


def add_org(c: Connection, now: datetime) -> None:
    """The organisation ``org.1``, in raw SQL (the same at every revision)."""
    c.execute(
        text(
            "INSERT INTO organisations (id, name, tier, zero_data_retention, created_at) "
            "VALUES ('org.1', 'acme', 0, false, :now)"
        ),
        {"now": now},
    )


def add_deferred_item(engine: Engine, now: datetime, **columns: Any) -> None:
    """An organisation, a deferred batch and its dispatched item ``i.1``, in raw SQL.

    For a migration test: the schema is whatever revision the test stopped at,
    so no table object of the current code may describe it. ``columns`` adds
    the item's columns of that revision (its lease, say).
    """
    extra = "".join(f", {name}" for name in columns)
    values = "".join(f", :{name}" for name in columns)
    with engine.begin() as c:
        add_org(c, now)
        c.execute(
            text(
                "INSERT INTO batches (id, org_id, key_id, status, min_discount, "
                "completion_window, request_count, created_at, deadline) VALUES "
                "('b.1', 'org.1', 'k.1', 'in_progress', '0', '24h', 1, :now, :now)"
            ),
            {"now": now},
        )
        c.execute(
            text(
                "INSERT INTO batch_items (id, batch_id, org_id, key_id, position, custom_id, "
                "status, model, min_discount, input_tokens, max_tokens, created_at, "
                f"deadline{extra}) "
                "VALUES ('i.1', 'b.1', 'org.1', 'k.1', 0, 'a', 'dispatched', 'm', '0', 1, 1, "
                f":now, :now{values})"
            ),
            {"now": now, **columns},
        )
